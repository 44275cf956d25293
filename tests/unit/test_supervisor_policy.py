"""The supervisor's restart policy on fake units and a fake clock (no sleeping), and the reaping
of a real child process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.runtime.process import Child
from services.runtime.supervisor import CrashLoop, RestartPolicy, Supervisor


class FakeUnit:
    def __init__(self, name: str) -> None:
        self.name = name
        self.code: int | None = None
        self.restarted = 0
        self.fail_restart = False

    def exit_code(self) -> int | None:
        return self.code

    def restart(self) -> None:
        self.restarted += 1
        if self.fail_restart:
            raise RuntimeError("port taken")
        self.code = None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(policy=RestartPolicy(restart_limit=3, restart_window_s=60, backoff_s=1, backoff_max_s=3)):
    clock, a, b = Clock(), FakeUnit("decode-0"), FakeUnit("prefill-0")
    return Supervisor(lambda: [a, b], policy, clock), clock, a, b


def test_dead_unit_restarts_after_backoff_and_others_are_untouched():
    sup, clock, a, b = make()
    a.code = -9
    sup.check()
    assert a.restarted == 0  # noticed; back-off of 1 s starts
    clock.now += 0.9
    sup.check()
    assert a.restarted == 0
    clock.now += 0.2
    sup.check()
    assert (a.restarted, a.code, b.restarted) == (1, None, 0)


def test_backoff_doubles_up_to_its_cap():
    sup, clock, a, _ = make(RestartPolicy(restart_limit=10, restart_window_s=600, backoff_s=1,
                                          backoff_max_s=3))
    delays = []
    for _ in range(4):
        a.code = 1
        sup.check()
        start = clock.now
        while a.restarted == len(delays):
            clock.now += 0.25
            sup.check()
        delays.append(clock.now - start)
    assert delays == [1.0, 2.0, 3.0, 3.0]


def test_crash_loop_stops_naming_the_unit():
    sup, clock, a, _ = make()
    for _ in range(3):
        a.code = 1
        sup.check()
        clock.now += 5
        sup.check()
    assert a.restarted == 3
    a.code = 137
    with pytest.raises(CrashLoop, match=r"decode-0 keeps exiting \(last exit code 137; "
                                        r"restarted 3 times within 60s\)"):
        sup.check()


def test_restarts_outside_the_window_are_forgotten():
    sup, clock, a, _ = make()
    for _ in range(3):
        a.code = 1
        sup.check()
        clock.now += 5
        sup.check()
        clock.now += 30  # each restart ages out of the 60 s window before the loop trips
    a.code = 1
    sup.check()  # no CrashLoop
    clock.now += 5
    sup.check()
    assert a.restarted == 4


def test_failed_restart_counts_and_is_retried():
    sup, clock, a, _ = make()
    a.code, a.fail_restart = 1, True
    for _ in range(3):
        sup.check()
        clock.now += 5
        sup.check()  # restart raises: still dead, noticed again next check
    with pytest.raises(CrashLoop, match="decode-0"):
        sup.check()


def test_child_exit_is_reaped_and_restart_runs_the_same_argv(tmp_path):
    argv = [sys.executable, "-c", f"open({str(tmp_path / 'runs')!r}, 'a').write('x'); raise SystemExit(3)"]
    child = Child("w", argv, {}, subprocess.Popen(argv))
    pid = child.proc.pid
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie now
    assert child.exit_code() == 3
    with pytest.raises(ChildProcessError):  # exit_code() reaped it: nothing left to wait for
        os.waitpid(pid, 0)
    child.restart()
    os.waitid(os.P_PID, child.proc.pid, os.WEXITED | os.WNOWAIT)
    assert child.proc.pid != pid
    assert child.exit_code() == 3 and (tmp_path / "runs").read_text() == "xx"
