"""The worker loads its engine on a thread that ends, taking its OpenMP team with it.

A team left idling on another thread makes libgomp count more OpenMP threads than CPUs, and it
then throttles every barrier's spin for the whole process (``services.runtime.serve.on_passing_thread``).
"""
from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from services.runtime.serve import on_passing_thread


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _settled(before: set[str], bound_s: float = 5.0) -> set[str]:
    """The process's threads once no thread beyond ``before`` is left, or at ``bound_s``
    (an ending thread's OpenMP team leaves in its thread-exit destructor, just after join)."""
    deadline = time.monotonic() + bound_s
    while (now := _tasks()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    return now


@pytest.fixture
def two_threads():
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(was)


def test_passing_thread_leaves_no_thread_and_no_openmp_team(two_threads):
    before = _tasks()

    def work() -> tuple[int, int]:
        torch.ones(1 << 22).sum()  # a parallel region: this thread's OpenMP team starts
        return threading.get_ident(), len(_tasks() - before)

    async def main() -> tuple[int, int, set[str]]:
        ident, started = await on_passing_thread(work)
        return ident, started, _settled(before)  # the event loop still runs: no executor shutdown

    ident, started, after = asyncio.run(main())
    assert ident != threading.get_ident()
    assert started >= 2  # the passing thread and at least one OpenMP team thread
    assert after - before == set()


def test_passing_thread_returns_and_raises_what_fn_does():
    assert asyncio.run(on_passing_thread(lambda a, b: a + b, 2, 3)) == 5

    def boom() -> None:
        raise ValueError("engine.model: no such file")

    with pytest.raises(ValueError, match="engine.model"):
        asyncio.run(on_passing_thread(boom))


def test_to_thread_keeps_the_team_the_reason_for_the_passing_thread(two_threads):
    """The failure mode itself, so the test above is known to be able to fail."""
    before = _tasks()

    async def main() -> set[str]:
        await asyncio.to_thread(lambda: torch.ones(1 << 22).sum())
        return _settled(before, bound_s=0.5)

    assert len(asyncio.run(main()) - before) >= 2
