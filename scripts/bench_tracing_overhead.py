"""What tracing costs: output tokens/s of one stack configuration with tracing off and on.

Each round starts a fresh stack (gateway + prefill + decode workers, `tandem up`'s launcher,
a private Redis) once with tracing off (no OTEL_* variables: the default, no-op path) and once
with tracing on (sampler always_on, every span exported over OTLP/gRPC to a receiver this
script runs, 200 ms batches), in alternating order (off/on, then on/off, ...) so that drift of
a shared machine does not favour one side. Each run sends the same random dataset (fixed prompt
and output lengths, ignore_eos) with ``--concurrency`` clients through loadtest's runner (the
client of `tandem bench serve`). Prints the figures and writes them as JSON (``--out``);
``cost`` is ``1 - on/off`` of the mean output throughput (target: under 3%).

Throughput of a whole run on two shared cores drifts by several percent from run to run, more
than tracing's cost; so each run also records the CPU seconds (user + system, from
``/proc/PID/stat``) that each stack process (gateway, prefill, decode) spent during the measured
load, per 1000 output tokens: ``cpu_cost`` is ``on/off - 1`` of the stack's total, the work
tracing adds whatever the machine's drift. The receiver's own CPU is this script's (with the
client's), not the stack's, and is reported apart (``client_cpu_s``). Before the runs, the CPU
of one request's spans is measured directly (``span_cpu_ms_per_request``).

    python -m scripts.bench_tracing_overhead --num-prompts 256 --concurrency 16 --rounds 4
    python -m scripts.bench_tracing_overhead --num-prompts 8 --output-len 8 --rounds 1   # smoke

Run it with ``-m`` from the checkout, so that this process and the stack it starts import the
same ``services``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from loadtest.arrivals import ArrivalSchedule
from loadtest.datasets import DatasetOptions, random_dataset
from loadtest.metrics import summarize
from loadtest.runner import RunConfig, run_benchmark
from loadtest.serve import load_tokenizer
from services import ports
from services.runtime.launcher import Stack, UpOptions


class SpanCounter(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that counts the spans it is sent."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.endpoint = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Export(self, request, context):
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.count += n
        return trace_service_pb2.ExportTraceServiceResponse()


def free_port() -> int:
    return ports.free_port("127.0.0.1")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat`` fields 14-15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SPAN_REQUESTS = 2000  # requests' worth of spans timed by span_cpu_ms_per_request


def span_cpu_ms_per_request(endpoint: str, n: int = SPAN_REQUESTS) -> float:
    """CPU ms this process spends on one request's spans, all three services' worth (the
    gateway's request span with its reservation child and W3C context injected, the prefill
    span with its kv_transfer child, the decode span with its kv_wait child, every attribute
    the services set; flushed every 100 requests so that none is dropped), exported by the
    SDK's batch processor over OTLP/gRPC to ``endpoint`` (the receiver in this process: its
    decoding is counted too). An upper bound of the work tracing adds per request, free of the
    run-to-run drift of whole-stack throughput."""
    from types import SimpleNamespace

    from services.observability import otel, tracing

    otel.configure("gateway", endpoint, environ={})
    params = SimpleNamespace(max_tokens=48, temperature=0.0, top_p=1.0, top_k=0, seed=None)
    record = SimpleNamespace(num_output_tokens=48,
                             outcome=lambda: (None, {"finish_reason": "length"}))
    start = time.process_time()
    for i in range(n):
        trace = tracing.request_trace(None, "text_completion", "SmolLM2-135M-Instruct")
        trace.requested(f"req-{i}", params, 128)
        with trace.child("kv_reservation", **{"tandem.attempt": 1}):
            pass
        context = SimpleNamespace(invocation_metadata=trace.metadata)
        prefill = tracing.worker_trace("prefill", context, f"req-{i}", 128)
        now = time.monotonic()
        prefill.kv_transfer(now, now, 8, 8 * 184320, "tcp", "landed")
        prefill.span.end()
        decode = tracing.worker_trace("decode", context, f"req-{i}", 128)
        otel.start_span("kv_wait", parent_span=decode.span).end()
        decode.span.set_attributes({"gen_ai.usage.output_tokens": 48})
        decode.span.end()
        trace.first_token()
        trace.finish(record)
        if i % 100 == 99:  # NOTE: below the batch processor's queue (2048 spans): none dropped
            otel._provider.force_flush()
    otel.shutdown()  # exports what is buffered: its CPU is counted
    return 1000 * (time.process_time() - start) / n


def run_once(args, requests, env: dict[str, str]) -> dict:
    """Start a stack with ``env``, run the load, stop it; the run's loadtest summary plus each
    stack process's CPU seconds per 1000 output tokens over the load (``cpu_per_1k``)."""
    stack = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=args.num_prefill,
                            num_decode=args.num_decode, redis_url=None,
                            worker_args=args.worker_args.split(), gateway_args=["--http-port", "0"],
                            env=env, ready_timeout_s=600))
    try:
        stack.start()
        stack.wait_ready()
        cfg = RunConfig(f"grpc://{stack.address}", ArrivalSchedule(math.inf),
                        max_concurrency=args.concurrency, num_warmups=args.num_warmups,
                        request_timeout_s=args.request_timeout, progress=False)
        procs = [(name, proc.pid) for name, proc in stack.procs if not name.startswith("redis")]
        before = {name: cpu_seconds(pid) for name, pid in procs}
        client_before = time.process_time()
        outcome = asyncio.run(run_benchmark(cfg, requests))
        spent = {name: cpu_seconds(pid) - before[name] for name, pid in procs}
        client_cpu = time.process_time() - client_before
    finally:
        stack.stop()
    summary = summarize(outcome.records, outcome.duration_s, {}, [50, 99])
    # NOTE: the warm-up requests ran inside the measured window too: count their (exact) tokens
    tokens = sum(r.output_tokens for r in outcome.records) + sum(
        r.output_len for r in requests[:args.num_warmups])
    summary["cpu_per_1k"] = {name: 1000 * s / max(tokens, 1) for name, s in spent.items()}
    summary["cpu_per_1k"]["stack"] = sum(summary["cpu_per_1k"].values())
    summary["client_cpu_s"] = client_cpu
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (exact: ignore_eos)")
    p.add_argument("--rounds", type=int, default=4, help="stack pairs (off + on) to run")
    p.add_argument("--num-warmups", type=int, default=16)
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--worker-args", default="--num-threads 1", help="extra flags of every worker")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--out", default="results/tracing_overhead.json")
    args = p.parse_args(argv)
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        del os.environ[key]  # "off" is the default: no OTEL_* at all
    requests = random_dataset(args.num_prompts, load_tokenizer(""),
                              DatasetOptions(input_len=args.input_len, output_len=args.output_len))
    receiver = SpanCounter()
    span_ms = span_cpu_ms_per_request(receiver.endpoint)
    print(f"spans of one request ({receiver.count / SPAN_REQUESTS:g}, all services, exported and received "
          f"here): {span_ms:.3f} CPU ms", flush=True)
    on_env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
              "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_TRACES_SAMPLER": "always_on",
              "OTEL_BSP_SCHEDULE_DELAY": "200"}
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            before = receiver.count
            summary = run_once(args, requests, on_env if mode == "on" else {})
            summary["spans_received"] = receiver.count - before
            runs[mode].append(summary)
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in summary["cpu_per_1k"].items())
            print(f"round {r} tracing {mode:3s}: {summary['output_throughput']:8.2f} output tok/s, "
                  f"{summary['completed']} completed, {summary['failed']} failed, "
                  f"{summary['spans_received']} spans received; CPU s per 1k tokens: {cpu}",
                  flush=True)
    receiver.server.stop(grace=None)
    result = report(args, runs, span_ms)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


def report(args, runs: dict[str, list[dict]], span_ms: float) -> dict:
    mean = {m: statistics.fmean(s["output_throughput"] for s in runs[m]) for m in runs}
    cost = 1 - mean["on"] / mean["off"]
    roles = list(runs["off"][0]["cpu_per_1k"])
    cpu = {m: {k: statistics.fmean(s["cpu_per_1k"][k] for s in runs[m]) for k in roles}
           for m in runs}
    cpu_cost = cpu["on"]["stack"] / cpu["off"]["stack"] - 1
    print(f"output tok/s at {args.concurrency} clients: off {mean['off']:.2f}, on {mean['on']:.2f}; "
          f"tracing costs {100 * cost:.2f}% of throughput (target < 3%)")
    for k in roles:
        print(f"  CPU s per 1k output tokens, {k:>10}: off {cpu['off'][k]:.3f}, on {cpu['on'][k]:.3f}")
    print(f"tracing adds {100 * cpu_cost:.2f}% to the stack's CPU per output token")
    request_ms = cpu["off"]["stack"] * args.output_len  # CPU ms of one request, tracing off
    print(f"one request's spans cost {span_ms:.3f} CPU ms of the stack's {request_ms:.0f}: "
          f"{100 * span_ms / request_ms:.3f}%")
    return {"config": vars(args), "host": platform.node(), "cpu_count": os.cpu_count(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "output_throughput_off": mean["off"], "output_throughput_on": mean["on"], "cost": cost,
            "cpu_per_1k_off": cpu["off"], "cpu_per_1k_on": cpu["on"], "cpu_cost": cpu_cost,
            "span_cpu_ms_per_request": span_ms, "stack_cpu_ms_per_request_off": request_ms,
            "runs": {m: [{k: s[k] for k in ("output_throughput", "completed", "failed", "duration",
                                              "mean_ttft_ms", "mean_tpot_ms", "spans_received",
                                              "cpu_per_1k", "client_cpu_s")}
                         for s in runs[m]] for m in runs}}


if __name__ == "__main__":
    raise SystemExit(main())
