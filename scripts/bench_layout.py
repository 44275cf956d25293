"""Which local layout serves fastest on this machine (issue 15, "every core"): each option is a
real stack (`tandem up`'s ``Stack``: gateway, workers, a private Redis) loaded by
``tandem bench serve`` at each concurrency, one option after another in one run.

    python -m scripts.bench_layout [--options all] [--concurrency 1,16] [--num-prompts 64] \\
        [--engine-args "--quantization auto"] [--result-dir bench-results/layout]

Workload (issue 15's): random prompts of ``--input-len`` tokens, outputs of 16-256 tokens
(``--output-len`` 136, range ratio 0.88) with ``ignore_eos``, greedy, all requests sent at once
under a concurrency cap; the single-stream run (concurrency 1) sends ``--single-stream-prompts``.
``--dataset long-mix`` (issue 37's long-prompt mix) sends the built-in chat prompts (up to
``--output-len`` tokens out) with, at probability ``--long-fraction``, a random prompt of
``--long-input-range`` tokens (8k by default) and ``--output-len`` tokens out in their place:
the long prefills that stall a unified worker's decode steps. ``--dataset chat`` sends the
built-in chat prompts alone, each run to EOS or ``--output-len`` tokens (the chat workload of
``tandem bench offline``: the same prompts in the same seeded order, so a served run sits
beside transformers' ``generate`` on them).
Options (``--options``, comma-separated names, or ``all``):

- ``disagg-1t``: 1 prefill + 1 decode worker, 1 thread each (the old default);
- ``disagg-1t-pinned``: the same, each worker's threads pinned to its own core;
- ``disagg-decode-all``: prefill 1 thread, decode every core (decode threads vs prefill's);
- ``disagg-all``: both workers every core (oversubscribed while both compute);
- ``unified``, ``unified-1t``: one unified worker with every core / one thread;
- ``unified-passive``, ``unified-active``: OpenMP wait policy (``OMP_WAIT_POLICY``) of the
  unified worker's threads: sleep at once, or spin, between parallel regions;
- ``unified-bind``: OpenMP threads bound to cores (``OMP_PROC_BIND=close``, ``OMP_PLACES=cores``).
- ``unified-4gw``, ``disagg-1t-4gw``: ``unified`` / ``disagg-1t`` behind 4 gateway processes on
  one port (``tandem up --num-gateways 4``); load them with ``--client-processes`` and
  ``--grpc-channels`` so that the client is not the bound and reaches every gateway.

On GPUs (the settings' engine on CUDA: ``TANDEM_DEVICE=cuda``, with ``TANDEM_MODEL`` /
``TANDEM_DTYPE`` as wanted) the workers are placed as `tandem up` places them: ``unified`` is
one worker on the GPU, ``disagg-1t`` a prefill and a decode worker sharing it (KV handoff by
CUDA IPC).

torch's inter-op pool is not an option: eager model execution runs no inter-op work (no
``torch.jit.fork``), so its size changes nothing the engine does. Prints a table (output tok/s,
TTFT p50, TPOT mean/median per option and concurrency) and writes ``layout.json`` (with what
``tandem up --layout auto`` picks here) plus each run's ``bench serve`` JSON and plots. The
machine must be quiet: compare figures only within one run.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtest import serve
from services import ports
from services.runtime.launcher import Stack, UpOptions
from services.runtime.layout import choose_layout, usable_cores
from services.config.settings import UpSection

log = logging.getLogger("bench_layout")


@dataclass(frozen=True)
class Option:
    """One layout: workers per role, threads per worker ("all": every usable core), extra
    environment for every child, whether to pin each worker to its own core, and gateway
    processes sharing the ports (``up.num_gateways``)."""

    name: str
    counts: dict[str, int]
    threads: dict[str, int | str]
    env: dict[str, str] = field(default_factory=dict)
    pin: bool = False
    gateways: int = 1


DISAGG = {"prefill": 1, "decode": 1}
OPTIONS = {o.name: o for o in [
    Option("disagg-1t", DISAGG, {"prefill": 1, "decode": 1}),
    Option("disagg-1t-pinned", DISAGG, {"prefill": 1, "decode": 1}, pin=True),
    Option("disagg-decode-all", DISAGG, {"prefill": 1, "decode": "all"}),
    Option("disagg-all", DISAGG, {"prefill": "all", "decode": "all"}),
    Option("unified", {"unified": 1}, {"unified": "all"}),
    Option("unified-1t", {"unified": 1}, {"unified": 1}),
    Option("unified-passive", {"unified": 1}, {"unified": "all"}, {"OMP_WAIT_POLICY": "PASSIVE"}),
    Option("unified-active", {"unified": 1}, {"unified": "all"}, {"OMP_WAIT_POLICY": "ACTIVE"}),
    Option("unified-bind", {"unified": 1}, {"unified": "all"},
           {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}),
    Option("unified-4gw", {"unified": 1}, {"unified": "all"}, gateways=4),
    Option("disagg-1t-4gw", DISAGG, {"prefill": 1, "decode": 1}, gateways=4),
]}


def start_stack(option: Option, cores: int, engine_args: list[str], port: int,
                http_port: int = 0) -> Stack:
    """``option``'s stack, ready (gRPC on ``port``; HTTP on ``http_port``, 0: off)."""
    threads = {role: cores if n == "all" else n for role, n in option.threads.items()}
    counts = {role: option.counts.get(role, 0) for role in ("prefill", "decode", "unified")}
    stack = Stack(UpOptions(
        host="127.0.0.1", port=port, num_prefill=counts["prefill"],
        num_decode=counts["decode"], num_unified=counts["unified"],
        redis_url=None, worker_args=engine_args, threads=threads, env=option.env,
        gateway_args=["--http-port", str(http_port)],  # 0: gRPC only, no collision on 8000
        ready_timeout_s=600, num_gateways=option.gateways))  # on CUDA placed as `tandem up` does
    try:
        stack.start()
        stack.wait_ready()
        if option.pin:
            pin_workers(stack)
    except BaseException:
        stack.stop()
        raise
    return stack


def pin_workers(stack: Stack) -> None:
    """Each worker process's threads (every task, so threads already started are pinned too)
    onto its own core, round-robin over the usable cores."""
    cpus = sorted(os.sched_getaffinity(0))
    workers = [(name, proc) for name, proc in stack.procs if not name.startswith("gateway")]
    for i, (name, proc) in enumerate(workers):
        cpu = cpus[i % len(cpus)]
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            os.sched_setaffinity(int(tid), {cpu})
        log.info("pinned %s (pid %d) to core %d", name, proc.pid, cpu)


def free_port() -> int:
    return ports.free_port("127.0.0.1")


def dataset_argv(args) -> list[str]:
    """``bench serve``'s dataset flags for ``--dataset``."""
    if args.dataset == "chat":
        return ["--dataset", "chat", "--chat-max-tokens", str(args.output_len)]
    if args.dataset == "long-mix":
        return ["--dataset", "long-mix", "--chat-max-tokens", str(args.output_len),
                "--long-fraction", str(args.long_fraction), "--long-input-range",
                args.long_input_range, "--long-output-len", str(args.output_len)]
    return ["--dataset", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio",
            str(args.output_range_ratio)]


def serve_argv(args, address: str, concurrency: int, out: Path, name: str) -> list[str]:
    n = args.single_stream_prompts if concurrency == 1 else args.num_prompts
    return ["--target", f"grpc://{address}", "--request-rate", "inf",
            "--max-concurrency", str(concurrency), "--num-prompts", str(n),
            *dataset_argv(args), "--num-warmups", "2", "--seed", str(args.seed),
            "--percentiles", "50,90,99", "--time-limit", str(args.time_limit),
            "--disable-progress", "--result-dir", str(out), "--result-name", name,
            "--client-processes", str(min(args.client_processes, concurrency, n)),
            "--grpc-channels", str(args.grpc_channels),
            *(["--tokenizer", os.environ["TANDEM_MODEL"]] if os.environ.get("TANDEM_MODEL") else [])]


FIGURES = ("output_throughput", "p50_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_itl_ms",
           "completed", "failed", "duration")


def run_option(args, option: Option, cores: int, out: Path) -> dict:
    """Start ``option``'s stack, load it at each concurrency, stop it: figures per concurrency."""
    t0 = time.perf_counter()
    stack = start_stack(option, cores, shlex.split(args.engine_args), args.port or free_port())
    figures = {"ready_s": round(time.perf_counter() - t0, 1)}
    try:
        for c in args.concurrency:
            name = f"{option.name}-c{c}"
            if serve.main(serve_argv(args, stack.address, c, out / option.name, name)) != 0:
                raise RuntimeError(f"{name}: bench serve failed")
            result = json.loads((out / option.name / f"{name}.json").read_text())
            figures[f"c{c}"] = {k: result.get(k) for k in FIGURES}
    finally:
        stack.stop()
    return figures


def print_table(results: dict, concurrency: list[int]) -> None:
    print(f"\n{'option':<20}" + "".join(f"{'c' + str(c) + ' tok/s':>12}{'TTFT p50':>10}"
                                        f"{'TPOT med':>10}" for c in concurrency))
    for name, figures in results.items():
        row = f"{name:<20}"
        for c in concurrency:
            f = figures[f"c{c}"]
            row += f"{f['output_throughput']:>12.1f}{f['p50_ttft_ms']:>10.1f}{f['median_tpot_ms']:>10.1f}"
        print(row)


def best_by_concurrency(results: dict, concurrency: list[int]) -> dict[str, str]:
    return {f"c{c}": max(results, key=lambda n: results[n][f"c{c}"]["output_throughput"] or 0)
            for c in concurrency}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_layout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--options", default="all", help=f"comma-separated: {', '.join(OPTIONS)}")
    p.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[1, 16])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--single-stream-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=136)
    p.add_argument("--output-range-ratio", type=float, default=0.88, help="136 +- 88%%: 16-256")
    p.add_argument("--dataset", choices=("random", "chat", "long-mix"), default="random")
    p.add_argument("--long-fraction", type=float, default=0.1,
                   help="long-mix: share of requests that are long random prompts")
    p.add_argument("--long-input-range", default="7936:8064", help="long-mix: LO:HI tokens")
    p.add_argument("--engine-args", default="--quantization auto",
                   help="worker flags of every option (the quantized default model by default)")
    p.add_argument("--time-limit", type=float, default=900.0, help="seconds per bench serve run")
    p.add_argument("--client-processes", type=int, default=1,
                   help="bench serve's --client-processes (at most the concurrency): on a GPU "
                        "one client process is the bound before the stack is")
    p.add_argument("--grpc-channels", type=int, default=1,
                   help="bench serve's --grpc-channels: connections of each client process "
                        "(the *-4gw options' gateways share a port: each channel reaches one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="gateway port of each option's stack "
                   "(0: a free one)")
    p.add_argument("--result-dir", default="bench-results/layout")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = list(OPTIONS) if args.options == "all" else args.options.split(",")
    unknown = [n for n in names if n not in OPTIONS]
    if unknown:
        raise SystemExit(f"--options: unknown {unknown}; known: {', '.join(OPTIONS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cores, out = usable_cores(), Path(args.result_dir)
    auto = choose_layout(UpSection(), cores)
    results = {}
    for name in names:
        log.info("option %s", name)
        results[name] = run_option(args, OPTIONS[name], cores, out)
    print_table(results, args.concurrency)
    summary = {"usable_cores": cores, "auto_layout": auto.describe(), "auto_reason": auto.reason,
               "engine_args": args.engine_args, "workload": {
                   "dataset": args.dataset, "long_fraction": args.long_fraction,
                   "long_input_range": args.long_input_range,
                   "input_len": args.input_len, "output_len": args.output_len,
                   "output_range_ratio": args.output_range_ratio, "num_prompts": args.num_prompts,
                   "single_stream_prompts": args.single_stream_prompts},
               "options": {n: {"counts": OPTIONS[n].counts, "threads": OPTIONS[n].threads,
                               "env": OPTIONS[n].env, "pin": OPTIONS[n].pin} for n in names},
               "results": results, "best": best_by_concurrency(results, args.concurrency)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "layout.json").write_text(json.dumps(summary, indent=2))
    print(f"\nauto here: {auto.describe()} ({auto.reason}); best: {summary['best']}")
    print(f"wrote {out / 'layout.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
