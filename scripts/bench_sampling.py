"""The sampler's cost on a CPU: the C kernel (``kernels.sampling``) against the torch path, in one
run (``python -m scripts.bench_sampling``).

Logits: the model's own (``--model``, default the built-in GGUF), captured from its decode
steps on the chat workload's prompts (``loadtest.workloads.chat_workload``, greedy,
``--capture-tokens`` tokens each): real next-token distributions, whose nuclei are far
narrower than random logits' (which would flatter neither path); printed: how many tokens
of a row weigh at least 2^-14 of the heaviest (the kernel's first candidates).

**The sampler alone**: ``services.engine.sampler.sample`` per batch size (``--batches``) and
setting: greedy; temperature 0.7; 0.7 + top-p 0.9; 1.0 + top-p 0.95; llama.cpp's default chain
(temperature 0.8, top-k 40, top-p 0.95, min-p 0.05); 1.0 + top-k 50; 0.7 + 5 logprobs. Each
call takes the next window of the captured rows; the kernel and the torch path (the kernel's
``available`` off) both run on it, which goes first alternating call by call (the second finds
the window in cache), ``--repeats`` calls each; the median CPU ms per call
(``time.process_time``, ``--threads`` torch threads, default 1).

**The engine**: ``--concurrency`` chat requests at temperature 0.7 and top-p 0.9 (seeded),
``--max-tokens`` each, through ``LLMEngine`` in the served precision (``--dtype`` and
``--quantization``, default ``auto``: the GGUF's blocks in place); kernel and torch path in
alternating rounds (``--rounds``). Once every request has its first token (the prompts are not
timed), its decode steps: output tokens per wall second and per CPU second, and the CPU ms per
step of the sample and forward phases. Greedy rows take the C argmax on both paths (the kernel
switch covers random rows and logprobs).

**Prompt logprobs**: ``services.engine.sampler.logprobs_of`` over a slice of 256 captured rows
with their top 5 (what a prompt-scoring step computes per ``PROMPT_LOGPROBS_SLICE``), both
paths alternating, ``--repeats`` calls each.

``--neighbour``: a busy-loop process (``python3 -c 'while True: pass'``, as
``scripts.bench_contention``'s) runs beside every measurement.

Prints a table and writes JSON (``--out``). Compare figures only within one run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kernels import sampling as cpu_sampling
from scripts.profile_decode_step import PhaseClock

SETTINGS = {  # name -> SamplingParams fields
    "greedy": {"temperature": 0.0},
    "T0.7": {"temperature": 0.7},
    "T0.7 p0.9": {"temperature": 0.7, "top_p": 0.9},
    "T1 p0.95": {"temperature": 1.0, "top_p": 0.95},
    "llama.cpp chain": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    "T1 k50": {"temperature": 1.0, "top_k": 50},
    "T0.7 logprobs 5": {"temperature": 0.7, "logprobs": 5},
}


def make_engine(model: str | None, dtype: str, quantization: str):
    from services.engine.engine import EngineConfig, LLMEngine
    from services.startup_heap import freeze_startup_heap

    engine = LLMEngine(EngineConfig(**({"model": model} if model else {}), dtype=dtype,
                                    quantization=quantization))
    engine.warm_up()
    freeze_startup_heap("bench_sampling")  # as a served worker does
    return engine


def chat_requests(engine, n: int, params_for) -> list:
    from loadtest.workloads import chat_workload
    from services.engine.tokenizer import Tokenizer

    workload = chat_workload(n, Tokenizer.load(engine.config.model))
    return [engine.make_request(f"bench-{time.monotonic_ns()}-{i}", list(r.prompt_token_ids),
                                params_for(i)) for i, r in enumerate(workload.requests)]


def capture_logits(engine, num_prompts: int, tokens: int) -> torch.Tensor:
    """The logits of every sampled row of greedy decoding on the chat prompts: ``[rows,
    vocab]`` float32."""
    from services.engine import model_runner
    from services.engine.sampling_params import SamplingParams

    rows: list[torch.Tensor] = []
    argmax = model_runner.argmax_rows
    model_runner.argmax_rows = lambda logits: (rows.append(logits.clone()), argmax(logits))[1]
    try:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        for r in chat_requests(engine, num_prompts, lambda i: params):
            engine.add_request(r)
        while engine.has_work():
            engine.step()
    finally:
        model_runner.argmax_rows = argmax
    return torch.cat(rows)


def sampling_batch(logits: torch.Tensor, fields: dict, step: int):
    """The step's ``SamplingBatch`` for rows of one setting (``InputBatch.sampling``'s)."""
    from services.engine.input_batch import InputBatch
    from services.engine.request import Request
    from services.engine.sampling_params import SamplingParams

    batch = InputBatch(max_model_len=64, block_size=16, vocab_size=logits.shape[1])
    requests = [Request(f"r{i}", [1], SamplingParams(seed=i, **fields), eos_token_id=0)
                for i in range(logits.shape[0])]
    rows = np.array([batch.add(r) for r in requests], dtype=np.int64)
    batch.num_tokens[rows] += step  # the draw of output token ``step``
    return batch.sampling(rows)


@contextlib.contextmanager
def kernel(on: bool):
    """The sampler's CPU kernel on, or off (the torch path) for the block's duration."""
    available = cpu_sampling.available
    if not on:
        cpu_sampling.available = lambda: False
    try:
        yield
    finally:
        cpu_sampling.available = available


def both_paths(calls: int, prepare) -> tuple[float, float]:
    """The median CPU ms of ``prepare(call)()`` on the kernel and on the torch path, for calls 1
    to ``calls`` (call 0 warms both): both paths run each call's function, which goes first
    alternating call by call (the second finds the call's data in cache)."""
    times: dict[str, list[float]] = {"kernel": [], "torch": []}
    for call in range(calls + 1):
        run = prepare(call)
        for path in ("kernel", "torch") if call % 2 else ("torch", "kernel"):
            with kernel(path == "kernel"):
                t0 = time.process_time()
                run()
                if call:
                    times[path].append(time.process_time() - t0)
    return statistics.median(times["kernel"]) * 1e3, statistics.median(times["torch"]) * 1e3


def bench_sampler(logits: torch.Tensor, batches: list[int], repeats: int) -> list[dict]:
    from services.engine.sampler import sample

    def prepare(batch: int, fields: dict):
        def for_call(call: int):
            start = call * batch * 7 % (logits.shape[0] - batch)
            window = logits[start:start + batch].contiguous()
            sb = sampling_batch(window, fields, call)
            return lambda: sample(window, sb)
        return for_call

    rows = []
    for batch in batches:
        for name, fields in SETTINGS.items():
            k, t = both_paths(repeats, prepare(batch, fields))
            rows.append({"batch": batch, "setting": name, "kernel_ms": k, "torch_ms": t,
                         "speedup": t / k if k else None})
            print(f"batch {batch:3d}  {name:17s} kernel {k:7.2f} ms   torch {t:7.2f} ms   "
                  f"{t / k:5.1f}x", flush=True)
    return rows


def heavy_tokens(logits: torch.Tensor) -> dict:
    """Per temperature, quantiles over the rows of the tokens that weigh at least 2^-14 of the
    largest (the kernel's first candidates, ``csrc/sampling.c``'s ``CANDIDATE_WEIGHTS``)."""
    out = {}
    for t in (0.7, 1.0):
        x = logits / t
        n = (torch.exp(x - x.max(-1, keepdim=True).values) >= 2**-14).sum(-1).double()
        out[str(t)] = {q: int(n.quantile(float(q))) for q in ("0.5", "0.9", "0.99")}
        print(f"tokens within 2^-14 of the heaviest at temperature {t}: median "
              f"{out[str(t)]['0.5']}, 90th percentile {out[str(t)]['0.9']}, 99th "
              f"{out[str(t)]['0.99']}", flush=True)
    return out


def bench_prompt_logprobs(logits: torch.Tensor, repeats: int, rows: int = 256) -> dict:
    from services.engine.sampler import logprobs_of

    window = logits[:rows].contiguous()
    index, chosen = torch.arange(window.shape[0]), window.argmax(-1)
    k, t = both_paths(repeats, lambda call: lambda: logprobs_of(window, index, chosen, 5))
    print(f"prompt logprobs, {window.shape[0]} rows, top 5: kernel {k:7.2f} ms   torch {t:7.2f} ms"
          f"   {t / k:5.1f}x", flush=True)
    return {"rows": window.shape[0], "kernel_ms": k, "torch_ms": t, "speedup": t / k}


def bench_engine(engine, concurrency: int, max_tokens: int, rounds: int) -> list[dict]:
    from services.engine.sampling_params import SamplingParams

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.7, top_p=0.9, seed=i, max_tokens=max_tokens,
                              ignore_eos=True)

    rows = []
    for rnd in range(rounds):
        for path in ("kernel", "torch") if rnd % 2 == 0 else ("torch", "kernel"):
            clock, timed = PhaseClock(), engine.metrics.timed
            requests = chat_requests(engine, concurrency, params)
            for r in requests:
                engine.add_request(r)
            started: set[str] = set()
            while len(started) < len(requests):  # the prompts: not what is measured
                started.update(o.request_id for o in engine.step())
            steps = tokens = 0
            engine.metrics.timed = lambda phase, fn, *args: clock(phase, timed, phase, fn, *args)
            try:
                with kernel(path == "kernel"):
                    w0, c0 = time.perf_counter(), time.process_time()
                    while engine.has_work():
                        tokens += sum(len(o.new_token_ids) for o in engine.step())
                        steps += 1
                    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            finally:
                del engine.metrics.timed
            row = {"round": rnd, "path": path, "concurrency": concurrency, "steps": steps,
                   "output_tokens": tokens, "tokens_per_s": tokens / wall,
                   "tokens_per_cpu_s": tokens / cpu,
                   "sample_cpu_ms_per_step": clock.cpu["sample"] / steps * 1e3,
                   "forward_cpu_ms_per_step": clock.cpu["forward"] / steps * 1e3}
            rows.append(row)
            print(f"engine round {rnd} {path:6s}: {row['tokens_per_s']:7.1f} tok/s, "
                  f"{row['tokens_per_cpu_s']:7.1f} tok/CPU-s, sample "
                  f"{row['sample_cpu_ms_per_step']:.2f} ms/step, forward "
                  f"{row['forward_cpu_ms_per_step']:.2f} ms/step", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_sampling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a GGUF file or checkpoint directory (default: built-in)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=15, help="calls per path, batch and setting")
    p.add_argument("--capture-prompts", type=int, default=32)
    p.add_argument("--capture-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the sampler part")
    p.add_argument("--concurrency", type=int, default=16, help="the engine part's requests")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2, help="engine rounds (0: skip that part)")
    p.add_argument("--neighbour", action="store_true", help="a busy-loop process beside it")
    p.add_argument("--out", type=Path, default=Path("bench_sampling.json"))
    args = p.parse_args(argv)
    if not cpu_sampling.available():
        print("the CPU sampling kernel is not built (no C compiler?)", file=sys.stderr)
        return 1
    busy = (subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.neighbour
            else None)
    try:
        engine = make_engine(args.model, args.dtype, args.quantization)
        logits = capture_logits(engine, args.capture_prompts, args.capture_tokens)
        print(f"{logits.shape[0]} captured rows of {logits.shape[1]} logits; "
              f"{'a busy neighbour' if busy else 'quiet'}; {args.threads} thread(s)", flush=True)
        heavy = heavy_tokens(logits)
        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        try:
            sampler_rows = bench_sampler(logits, args.batches, args.repeats)
            prompt_row = bench_prompt_logprobs(logits, args.repeats)
        finally:
            torch.set_num_threads(threads)
        engine_rows = bench_engine(engine, args.concurrency, args.max_tokens, args.rounds)
    finally:
        if busy is not None:
            busy.kill()
    args.out.write_text(json.dumps({
        "command": " ".join(["python -m scripts.bench_sampling", *(argv or sys.argv[1:])]),
        "neighbour": args.neighbour, "threads": args.threads, "captured_rows": logits.shape[0],
        "heavy_tokens": heavy,
        "sampler": sampler_rows, "prompt_logprobs": prompt_row, "engine": engine_rows},
        indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
