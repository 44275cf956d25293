"""Restart what dies, as Kubernetes restarts a container: ``tandem up``'s supervision loop.

A child (worker, gateway or the private redis-server) that exits is reaped at once (no zombie),
then started again after a back-off that doubles with each restart in the last
``restart_window_s`` seconds (Kubernetes' CrashLoopBackOff: 10 s doubling to 5 min; ours is
shorter because a local stack should come back in seconds). Every other process keeps serving
meanwhile: the gateway migrates streams off a dead decode worker and retries prompts of a dead
prefill worker. A child that has already been restarted ``restart_limit`` times within the
window is in a crash loop: ``check()`` raises ``CrashLoop`` naming it, and the caller stops the
stack. A child that exits 0 was told to stop (SIGTERM: it drained, ``services/runtime/drain.py``) and
is not restarted: only crashes are.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

log = logging.getLogger(__name__)


class CrashLoop(RuntimeError):
    """A child keeps exiting; the message names it, its last exit code and its restarts."""


class Unit(Protocol):
    """Something the supervisor watches: one child process it can start again."""
    name: str

    def exit_code(self) -> int | None:
        """None while running; else the exit code (negative: killed by that signal), after
        reaping the process."""

    def restart(self) -> None:
        """Start it again with the same identity (worker id, port, password). May raise
        RuntimeError; the unit then still reports an exit code and is retried."""


@dataclass(frozen=True)
class RestartPolicy:
    """``restart_limit`` restarts within ``restart_window_s`` seconds, each after
    ``backoff_s * 2**recent_restarts`` seconds, at most ``backoff_max_s``."""
    restart_limit: int = 5
    restart_window_s: float = 60.0
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0


@dataclass
class _History:
    restarts: list[float] = field(default_factory=list)  # monotonic times of restarts
    restart_at: float | None = None  # a death was noticed: restart at this time


class Supervisor:
    """Watches ``units()`` (called on every check, so units added later are watched too)."""

    def __init__(self, units: Callable[[], list[Unit]], policy: RestartPolicy = RestartPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.units = units
        self.policy = policy
        self.clock = clock
        self.history: dict[str, _History] = {}
        self.restarts = 0  # total, for logs and tests
        self.stopped: set[str] = set()  # units that exited 0: told to stop, never restarted

    def check(self) -> None:
        """Reap and restart dead units whose back-off has passed. Raises CrashLoop."""
        now = self.clock()
        for unit in self.units():
            code = unit.exit_code()
            if code is None:
                continue
            if code == 0:  # it was told to stop (SIGTERM: drained) and did: not a crash
                if unit.name not in self.stopped:
                    log.info("%s exited 0 (drained on request): not restarted", unit.name)
                    self.stopped.add(unit.name)
                continue
            hist = self.history.setdefault(unit.name, _History())
            if hist.restart_at is None:
                hist.restart_at = now + self._backoff(unit.name, code, hist, now)
            elif now >= hist.restart_at:
                hist.restart_at = None
                hist.restarts.append(now)
                self.restarts += 1
                try:
                    unit.restart()
                    log.info("%s restarted", unit.name)
                except RuntimeError as exc:
                    log.warning("%s failed to restart: %s", unit.name, exc)

    def _backoff(self, name: str, code: int, hist: _History, now: float) -> float:
        p = self.policy
        hist.restarts = [t for t in hist.restarts if now - t < p.restart_window_s]
        if len(hist.restarts) >= p.restart_limit:
            raise CrashLoop(f"{name} keeps exiting (last exit code {code}; restarted "
                            f"{len(hist.restarts)} times within {p.restart_window_s:g}s): "
                            "stopping the stack")
        delay = min(p.backoff_s * 2 ** len(hist.restarts), p.backoff_max_s)
        log.warning("%s exited with code %s; restarting it in %.1fs", name, code, delay)
        return delay

    def run(self, should_stop: Callable[[], bool], interval_s: float = 0.2) -> None:
        """Check every ``interval_s`` seconds until ``should_stop()``. Raises CrashLoop."""
        while not should_stop():
            self.check()
            time.sleep(interval_s)
