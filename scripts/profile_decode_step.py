"""CPU cost of one decode step, in process (``python -m scripts.profile_decode_step``).

The engine on the built-in GGUF (``--dtype``/``--quantization``, default ``auto``/``auto``: the
served default), per batch size (default 1, 16, 64): ``batch`` greedy requests of 16 random
prompt tokens are prefilled, ``--warmup`` decode steps run, then ``--steps`` decode steps are
timed in CPU seconds of this process (``time.process_time``: every thread's CPU time, steady on
a loaded machine; wall time is not measured), and ``--profile-steps`` more run under
``torch.profiler``: aten ops per step and the top ops by self CPU time. Also the CPU split of
the runner's phases (prepare_inputs, forward, sample) and the rest of ``engine.step``.

Prints a table and writes JSON (``--out``). Compare figures only within one run and one thread
count (``--threads``; with 2, OpenMP's waiting threads count as CPU time too).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch


def make_engine(dtype: str, quantization: str, max_batch: int):
    from services.engine.engine import EngineConfig, LLMEngine

    e = LLMEngine(EngineConfig(dtype=dtype, quantization=quantization, num_kv_blocks=2048,
                               max_num_seqs=max(64, max_batch)))
    e.warm_up()
    return e


def _start(e, batch: int, tokens: int, seed: int) -> None:
    """Add ``batch`` greedy requests and step until every one has its first token."""
    from scripts.bench_quant import start_batch

    start_batch(e, batch, tokens, seed, tag="p")


class PhaseClock:
    """``timed`` for ``ModelRunner.execute``: CPU seconds per phase (process_time)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)

    def __call__(self, phase: str, fn, *args):
        t0 = time.process_time()
        try:
            return fn(*args)
        finally:
            self.cpu[phase] += time.process_time() - t0


def profile_batch(e, batch: int, warmup: int, steps: int, profile_steps: int, top: int,
                  seed: int) -> dict:
    """Decode-step figures at ``batch`` running sequences (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    _start(e, batch, warmup + steps + profile_steps + 4, seed)
    for _ in range(warmup):
        e.step()
    clock = PhaseClock()
    run_model = e.runner.execute
    e.runner.execute = lambda out, timed=None: run_model(out, clock)
    try:
        t0, w0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            e.step()
        cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    finally:
        e.runner.execute = run_model
    events = []
    if profile_steps:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(profile_steps):
                e.step()
        events = [a for a in prof.key_averages() if a.key.startswith("aten::")]
    while e.has_work():  # the batch finishes in a few steps: the next starts from empty
        e.step()
    ops = sum(a.count for a in events)
    profile_steps = max(profile_steps, 1)
    events.sort(key=lambda a: a.self_cpu_time_total, reverse=True)
    phases = {k: v / steps * 1e3 for k, v in clock.cpu.items()}
    phases["engine_rest"] = cpu / steps * 1e3 - sum(phases.values())
    return {
        "batch": batch,
        "cpu_ms_per_step": cpu / steps * 1e3,
        "wall_ms_per_step": wall / steps * 1e3,
        "phase_cpu_ms_per_step": phases,
        "aten_ops_per_step": ops / profile_steps,
        "top_ops": [{"op": a.key, "calls_per_step": a.count / profile_steps,
                     "self_cpu_ms_per_step": a.self_cpu_time_total / profile_steps / 1e3}
                    for a in events[:top]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", default="profile_decode_step.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    e = make_engine(args.dtype, args.quantization, max(batches))
    rows = [profile_batch(e, b, args.warmup, args.steps, args.profile_steps, args.top, seed=b)
            for b in batches]
    result = {"precision": vars(e.precision), "threads": args.threads, "steps": args.steps,
              "torch": torch.__version__, "rows": rows}
    print(f"precision {e.precision}, {args.threads} thread(s), {args.steps} timed steps")
    for r in rows:
        split = ", ".join(f"{k} {v:.2f}" for k, v in r["phase_cpu_ms_per_step"].items())
        print(f"batch {r['batch']:3d}: {r['cpu_ms_per_step']:8.2f} CPU ms/step, "
              f"{r['wall_ms_per_step']:8.2f} wall ms/step, "
              f"{r['aten_ops_per_step']:7.0f} aten ops/step ({split})")
        for o in r["top_ops"]:
            print(f"    {o['op']:32s} {o['calls_per_step']:7.0f} calls "
                  f"{o['self_cpu_ms_per_step']:8.3f} ms self")
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
