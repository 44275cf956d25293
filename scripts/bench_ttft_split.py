"""Where a disaggregated request's time to first token goes (issue 37), per prompt length:
``python -m scripts.bench_ttft_split``.

A 1P+1D stack (`tandem up`'s ``Stack``, a private Redis; the settings' device and precision, so
``TANDEM_DEVICE=cuda`` puts both workers on the GPU with the KV handed over by CUDA IPC) gets
``--repeats`` requests per prompt length (random token ids, one token out), one at a time so
that no request waits for another. Every prompt goes through the prefill worker
(``--pd-threshold-tokens 0``). Each request's record (``GetRequest``: the gateway's timestamps
and what the prefill worker reported) splits its TTFT into

- gateway: arrival to the prefill worker starting the request (tokenization, routing, the
  decode worker's KV reservation);
- prefill queue and prefill compute: as the prefill worker reports them;
- KV transfer: the prefill worker's write of the prompt's blocks into the decode worker's;
- decode admit: the prefill worker's answer to the first token reaching the gateway (the first
  token is sampled by the prefill worker: the decode worker admits the request with it and
  streams it; its first decode step makes the second token, outside the TTFT);
- other: what the parts above leave of the TTFT (gRPC hops, clock granularity).

Prints the median of each part per prompt length and writes JSON (``--out``).

    python -m scripts.bench_ttft_split [--tokens 128 512 2048 8064] [--repeats 8] \
        [--engine-args=--enforce-eager]

``--engine-args``: flags of both workers (on a GPU, ``--enforce-eager`` launches prefill steps
from Python instead of replaying them from CUDA graphs: run both to compare).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shlex
import statistics
from pathlib import Path

import grpc

from scripts.bench_layout import free_port
from services.api import gateway_pb2, gateway_pb2_grpc
from services.runtime.launcher import Stack, UpOptions

PARTS = ("gateway", "prefill_queue", "prefill_compute", "kv_transfer", "decode_admit", "other")


def split(info: gateway_pb2.RequestInfo) -> dict[str, float]:
    """One request's TTFT and its parts, milliseconds."""
    ttft = info.first_token_time - info.arrival_time
    parts = {
        "gateway": info.prefill_start_time - info.arrival_time,
        "prefill_queue": info.prefill_queue_time,
        "prefill_compute": info.prefill_compute_time,
        "kv_transfer": info.kv_transfer_time,
        "decode_admit": info.first_token_time - info.prefill_end_time,
    }
    parts["other"] = ttft - sum(parts.values())
    return {"ttft": ttft * 1e3, **{k: v * 1e3 for k, v in parts.items()}}


async def measure(address: str, tokens: list[int], repeats: int, vocab: int) -> list[dict]:
    rng, rows = random.Random(0), []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for n in tokens:
            for i in range(repeats + 1):  # the first of each length warms its shapes up
                rid = f"split-{n}-{i}"
                ids = [rng.randrange(100, vocab) for _ in range(n)]
                async for _ in stub.Generate(gateway_pb2.GenerateRequest(
                        request_id=rid, prompt_token_ids=ids, max_tokens=1, temperature=0.0,
                        ignore_eos=True), timeout=600):
                    pass
                # NOTE: the prefill worker's answer can reach the gateway after the first
                # token did (the decode worker streams it as soon as the KV landed): its
                # figures are in the record a moment later
                for _ in range(100):
                    info = await stub.GetRequest(gateway_pb2.GetRequestRequest(request_id=rid))
                    if info.prefill_end_time:
                        break
                    await asyncio.sleep(0.05)
                if i:
                    rows.append({"num_tokens": n, **split(info)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048, 8064])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    p.add_argument("--engine-args", default="", help="worker flags, e.g. --engine-args=--enforce-eager")
    p.add_argument("--out", type=Path, default=Path("bench-results/ttft_split.json"))
    args = p.parse_args()
    stack = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=1, num_decode=1,
                            redis_url=None, worker_args=shlex.split(args.engine_args),
                            gateway_args=["--http-port", "0", "--pd-threshold-tokens", "0"],
                            ready_timeout_s=600))
    try:
        stack.start()
        stack.wait_ready()
        rows = asyncio.run(measure(stack.address, args.tokens, args.repeats, args.vocab))
    finally:
        stack.stop()
    medians = {n: {k: statistics.median(r[k] for r in rows if r["num_tokens"] == n)
                   for k in ("ttft", *PARTS)} for n in args.tokens}
    print(f"median ms over {args.repeats} requests each (one at a time, 1 output token)")
    print(f"{'tokens':>7} {'TTFT':>9} " + " ".join(f"{k:>15}" for k in PARTS))
    for n, m in medians.items():
        print(f"{n:>7} {m['ttft']:>9.1f} " + " ".join(f"{m[k]:>15.1f}" for k in PARTS))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.machine(), "tokens": args.tokens,
                                    "engine_args": args.engine_args, "repeats": args.repeats,
                                    "medians": medians, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
