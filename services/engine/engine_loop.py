"""Runs an ``LLMEngine`` on its own thread so model forward passes never block an event loop.

Callers ``submit`` commands (``commands.py``: the whole list of what a caller may ask; thread
safe); the loop applies them between steps, steps while there is work, and hands every
``RequestOutput`` to ``on_outputs`` from the engine thread. A request the engine fails alone
comes out as an output with ``error`` (see ``LLMEngine.step``). When the engine cannot continue
the thread ends: ``on_fatal(exc)`` is called once from it, every queued command's future fails
with ``EngineDeadError``, and so does every later ``submit``.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from . import commands as c
from .engine import LLMEngine
from .outputs import EngineDeadError, RequestOutput

log = logging.getLogger(__name__)

_STOP = object()
# the engine thread's name as the OS sees it (``/proc/PID/task/TID/comm``, ``top -H``); the
# OpenMP threads its kernels start inherit it, so a process's CPU splits into the model's and
# the rest's (scripts/bench_serving_cpu.py)
ENGINE_THREAD_NAME = "tandem-engine"


def _name_os_thread(name: str) -> None:
    """Set the calling thread's OS name (Linux ``prctl(PR_SET_NAME)``, 15 bytes); elsewhere
    nothing."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


class EngineLoop:
    """Owns the engine thread. ``submit(command)`` returns a Future of the command's result."""

    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[RequestOutput]], None],
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_fatal = on_fatal
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._lock = threading.Lock()  # orders submit() against the thread's death
        self.dead: BaseException | None = None  # why the engine stopped, once it has died

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        """Whether the engine thread runs (False before ``start``, after ``stop`` or death)."""
        return self._thread.is_alive() and self.dead is None

    def submit(self, command: c.EngineCommand) -> Future:
        """Apply ``command`` on the engine thread before its next step. The future fails with
        ``EngineDeadError`` when the engine has died (at once, or when it dies first)."""
        fut: Future = Future()
        with self._lock:
            if self.dead is None:
                self._commands.put((command, fut))
                return fut
        fut.set_exception(EngineDeadError(f"the engine has stopped: {self.dead}"))
        return fut

    def _run(self) -> None:
        _name_os_thread(ENGINE_THREAD_NAME)
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the engine cannot go on: say so, once
            log.critical("engine thread died: %s: %s", type(exc).__name__, exc, exc_info=exc)
            self._die(exc)

    def _serve(self) -> None:
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
                outputs = self.engine.step()
                if outputs:
                    self._on_outputs(outputs)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self.dead = exc
        while True:  # nothing is added after ``dead`` is set
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd is not _STOP and cmd[1].set_running_or_notify_cancel():
                cmd[1].set_exception(EngineDeadError(f"the engine has stopped: {exc}"))
        if self._on_fatal is not None:
            self._on_fatal(exc)

    def _apply(self, command: c.EngineCommand, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(self._dispatch(command))
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            fut.set_exception(exc)

    def _dispatch(self, command: c.EngineCommand):
        e = self.engine
        match command:
            case c.AddRequest(rid, prompt, params, hold_kv):
                request = e.make_request(rid, prompt, params, hold_kv=hold_kv)
                e.add_request(request)
                return request
            case c.Reserve(rid, prompt, params):
                request = e.make_request(rid, prompt, params)
                return request if e.reserve(request) else None
            case c.FinishRemotePrefill(rid, first_token_id, logprobs):
                return e.finish_remote_prefill(rid, first_token_id, logprobs)
            case c.PrefillLocally(rid):
                return e.prefill_locally(rid)
            case c.Abort(rid):
                return e.abort(rid)
            case c.Release(rid):
                return e.release(rid)
        raise TypeError(f"not an engine command: {type(command).__name__}")
