"""Runs an ``LLMEngine`` on its own thread so model forward passes never block an event loop.

Callers submit commands (thread-safe); the loop applies them between steps, steps while there is
work, and hands every ``RequestOutput`` to ``on_outputs`` from the engine thread.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .engine import LLMEngine
from .scheduler import RequestOutput

log = logging.getLogger(__name__)

_STOP = object()


class EngineLoop:
    """Owns the engine thread. ``call(fn)`` runs ``fn(engine)`` on it and returns a Future."""

    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[RequestOutput]], None]) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.step_count = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout_s)

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run ``fn(engine)`` on the engine thread before its next step."""
        fut: Future = Future()
        self._commands.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            block = not self.engine.has_work()
            try:
                while True:
                    cmd = self._commands.get(block=block)
                    if cmd is _STOP:
                        return
                    self._apply(*cmd)
                    block = False
            except queue.Empty:
                pass
            if self.engine.has_work():
                try:
                    outputs = self.engine.step()
                except Exception:  # a broken step must not leave every stream hanging
                    log.exception("engine step failed")
                    raise
                self.step_count += 1
                if outputs:
                    self._on_outputs(outputs)

    def _apply(self, fn: Callable[[LLMEngine], Any], fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(self.engine))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            fut.set_exception(exc)
