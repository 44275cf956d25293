"""A short prompt behind a long one on a 1 prefill + 1 decode stack: its TTFT with conditional
disaggregation (``--pd-threshold-tokens``) against the same prompt on the idle stack, and with
the threshold off (every prompt through the prefill worker's queue), in one run.

    python -m scripts.bench_pd_threshold --thresholds 256,0 --long-tokens 8000 --repeats 3

For each threshold: a fresh stack; the short chat prompt ``--repeats`` times alone (idle TTFT);
then for each repeat a long prompt of about ``--long-tokens`` tokens (max_tokens 2) and, one
second later, the short prompt (busy TTFT). Prints the medians and their ratio (the issue's
target: busy within 2x of idle) and writes JSON (``--out``). Timings only compare within a run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import statistics
import time
from pathlib import Path

import grpc

from services.api import gateway_pb2, gateway_pb2_grpc
from scripts.bench_layout import free_port
from services.engine.model_files import default_model_path
from services.engine.tokenizer import Tokenizer
from services.runtime.launcher import Stack, UpOptions

SHORT = "What is the capital of France? Answer in one word."


async def ttft(address: str, request: gateway_pb2.GenerateRequest) -> float:
    t0 = time.perf_counter()
    async with grpc.aio.insecure_channel(address) as ch:
        first = None
        async for msg in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=1800):
            if msg.token_ids and first is None:
                first = time.perf_counter() - t0
    return first


def short_request() -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content=SHORT)],
                                       max_tokens=4, temperature=0.0, ignore_eos=True)


async def measure(address: str, args) -> dict:
    idle = [await ttft(address, short_request()) for _ in range(args.repeats)]
    busy = []
    tok = Tokenizer.load(default_model_path())
    for i in range(args.repeats):
        words = " ".join(f"w{(i * 131 + j) % 997}" for j in range(args.long_tokens // 3))
        long = asyncio.ensure_future(ttft(address, gateway_pb2.GenerateRequest(
            prompt=tok.decode(tok.encode(words)[:args.long_tokens]), max_tokens=2,
            temperature=0.0, ignore_eos=True)))
        await asyncio.sleep(1.0)
        busy.append(await ttft(address, short_request()))
        await long
    return {"idle_ttft_s": idle, "busy_ttft_s": busy,
            "ratio": statistics.median(busy) / statistics.median(idle)}


def run(args, threshold: int) -> dict:
    stack = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=1, num_decode=1,
                            redis_url=None, worker_args=shlex.split(args.engine_args),
                            gateway_args=["--http-port", "0", "--pd-threshold-tokens", str(threshold)],
                            ready_timeout_s=900))
    try:
        stack.start()
        stack.wait_ready()
        return asyncio.run(measure(stack.address, args))
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_pd_threshold", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--thresholds", default="256,0")
    p.add_argument("--long-tokens", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engine-args", default="--num-threads 1 --kv-cache-gib 1")
    p.add_argument("--out", default="bench-results/pd_threshold.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results = {}
    for threshold in [int(t) for t in args.thresholds.split(",")]:
        r = results[threshold] = run(args, threshold)
        print(f"pd_threshold_tokens {threshold}: short prompt TTFT idle "
              f"{1e3 * statistics.median(r['idle_ttft_s']):.0f} ms, behind a "
              f"{args.long_tokens}-token prompt {1e3 * statistics.median(r['busy_ttft_s']):.0f} ms "
              f"({r['ratio']:.2f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": vars(args), "results": results}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
