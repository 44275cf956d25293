"""scripts/bench_serving_cpu.py: a process's CPU splits by thread name into the model's (the
engine thread and the OpenMP threads it starts, named tandem-engine) and the rest's."""
from __future__ import annotations

import os
import threading
import time

from scripts.bench_serving_cpu import cpu_split, per_token
from services.engine.engine_loop import ENGINE_THREAD_NAME, _name_os_thread


def test_engine_named_threads_are_counted_as_the_model():
    spun, measured = threading.Event(), threading.Event()

    def spin():  # 0.3 s of this thread's own CPU, however busy the machine is
        _name_os_thread(ENGINE_THREAD_NAME)
        while time.thread_time() < 0.3:
            pass
        spun.set()
        measured.wait(60)  # a thread that has exited leaves /proc/PID/task, and its CPU with it

    t = threading.Thread(target=spin)
    before = cpu_split(os.getpid())
    t.start()
    try:
        assert spun.wait(60)
        total, engine = (a - b for a, b in zip(cpu_split(os.getpid()), before))
    finally:
        measured.set()
        t.join()
    assert engine >= 0.2 and total >= engine - 1e-6  # the busy thread's CPU, at clock-tick resolution


def test_per_token_splits_workers_and_sums_what_is_outside_the_model():
    before = {"gateway": (1.0, 0.0), "unified-0": (10.0, 8.0), "redis": (0.5, 0.0),
              "client": (2.0, 0.0)}
    after = {"gateway": (1.3, 0.0), "unified-0": (20.1, 18.0), "redis": (0.6, 0.0),
             "client": (2.4, 0.0)}
    got = per_token(before, after, tokens=1000)
    assert set(got) == {"gateway", "unified-0.model", "unified-0.serving", "redis", "client",
                        "outside_model"}
    assert abs(got["client"] - 0.4) < 1e-9  # reported, not counted as the stack's
    assert abs(got["gateway"] - 0.3) < 1e-9 and abs(got["unified-0.model"] - 10.0) < 1e-9
    assert abs(got["unified-0.serving"] - 0.1) < 1e-9 and abs(got["redis"] - 0.1) < 1e-9
    assert abs(got["outside_model"] - 0.5) < 1e-9
