"""scripts/bench_serving_cpu.py: a process's CPU splits by thread name into the model's (the
engine thread and the OpenMP threads it starts, named tandem-engine) and the rest's; the client's
CPU counts the client processes it ran; the in-process engine takes the stack's workers'
settings."""
from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

from scripts.bench_serving_cpu import client_cpu, cpu_split, per_token, worker_settings
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


def _spin(seconds: float) -> None:
    while time.process_time() < seconds:
        pass


def test_client_cpu_counts_the_client_processes_it_joined():
    before = client_cpu()[0]
    child = multiprocessing.get_context("spawn").Process(target=_spin, args=(0.3,))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    # the child's 0.3 s of CPU (and its interpreter's start-up) are in; this process did not spin
    assert client_cpu()[0] - before >= 0.3


def test_the_in_process_engine_takes_the_workers_flags_over_the_environment(tmp_path):
    model = tmp_path / "other.gguf"
    environ = {"TANDEM_MODEL": str(model), "TANDEM_DEVICE": "cuda", "TANDEM_DTYPE": "bfloat16",
               "TANDEM_MAX_NUM_SEQS": "8", "TANDEM_NUM_GATEWAYS": "4", "TANDEM_LAYOUT": "unified"}
    s = worker_settings(["--quantization", "none", "--max-num-seqs", "64"], environ).settings
    config = s.engine.engine_config()
    assert config.model == str(model)  # the model the stack's workers load, not the built-in one
    assert (config.device, config.dtype, config.quantization) == ("cuda", "bfloat16", "none")
    assert config.max_num_seqs == 64  # the flag over the environment, as a worker reads them
    assert worker_settings([], environ).settings.engine.max_num_seqs == 8
    assert config.max_step_ms == 150.0  # the served default, which the workers run with
    assert s.up.num_gateways == 4 and s.up.layout.value == "unified"  # tandem up's, from the env


def test_worker_settings_refuse_what_a_worker_would():
    with pytest.raises(SystemExit):  # `tandem up`'s flag: not one a worker takes
        worker_settings(["--num-gateways", "4"], {})
    with pytest.raises(Exception, match="max_num_seqs"):
        worker_settings(["--max-num-seqs", "0"], {})
