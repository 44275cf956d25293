"""Online benchmark against a gateway: N streaming chat requests at a concurrency cap.

Per request it records TTFT (request sent -> first token), TPOT (mean time per output token
after the first), ITLs (gaps between streamed messages) and end-to-end latency; overall it
reports output tokens/s and requests/s. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from services.api import gateway_pb2, gateway_pb2_grpc

PROMPTS = [
    "What is the capital of France?", "Write a short poem about the sea.",
    "Explain in two sentences what a hash table is.", "List three fruits that are red.",
    "How many legs does a spider have? Answer and explain.", "Give me two tips for sleeping better.",
    "Translate 'good morning' into Spanish and German.", "Write a Python function that reverses a string.",
]


@dataclass
class RequestResult:
    ttft_s: float
    latency_s: float
    output_tokens: int
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float:
        return (self.latency_s - self.ttft_s) / max(self.output_tokens - 1, 1)


async def one_request(stub, prompt: str, max_tokens: int) -> RequestResult:
    req = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content=prompt)],
                                      max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    stamps, n = [], 0
    async for msg in stub.Generate(req, timeout=600):
        if msg.token_ids:
            stamps.append(time.perf_counter())
            n += len(msg.token_ids)
    return RequestResult(stamps[0] - start, stamps[-1] - start, n,
                         [b - a for a, b in zip(stamps, stamps[1:])])


async def run(address: str, num_requests: int, concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def bounded(i: int) -> RequestResult:
            async with sem:
                return await one_request(stub, PROMPTS[i % len(PROMPTS)], max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(num_requests)))
        elapsed = time.perf_counter() - t0
    return summarize(results, elapsed, concurrency, max_tokens)


def _pcts(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"mean": statistics.fmean(values), "p50": pick(0.5), "p99": pick(0.99)}


def summarize(results: list[RequestResult], elapsed: float, concurrency: int, max_tokens: int) -> dict:
    out_tokens = sum(r.output_tokens for r in results)
    return {
        "num_requests": len(results), "concurrency": concurrency, "max_tokens": max_tokens,
        "elapsed_s": elapsed, "output_tokens_per_s": out_tokens / elapsed,
        "requests_per_s": len(results) / elapsed,
        "ttft_s": _pcts([r.ttft_s for r in results]), "tpot_s": _pcts([r.tpot_s for r in results]),
        "itl_s": _pcts([x for r in results for x in r.itl_s] or [0.0]),
        "latency_s": _pcts([r.latency_s for r in results]),
    }


def print_table(rows: list[dict]) -> None:
    print(f"{'conc':>4} {'reqs':>4} {'out tok/s':>9} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT mean':>9} {'ITL p50':>8} {'ITL p99':>8}")
    for r in rows:
        print(f"{r['concurrency']:>4} {r['num_requests']:>4} {r['output_tokens_per_s']:>9.1f} "
              f"{r['requests_per_s']:>6.2f} {r['ttft_s']['p50']*1e3:>7.0f}ms {r['ttft_s']['p99']*1e3:>7.0f}ms "
              f"{r['tpot_s']['mean']*1e3:>7.1f}ms {r['itl_s']['p50']*1e3:>6.1f}ms {r['itl_s']['p99']*1e3:>6.1f}ms")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--concurrency", default="1,16", help="comma-separated; one run each")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=0, help="per run (default: 2 x concurrency, at least 4)")
    p.add_argument("--out", default="bench-results/online.json")
    args = p.parse_args(argv)
    rows = []
    asyncio.run(run(args.address, 2, 1, 8))  # warm-up: connections, first-call paths
    for c in (int(x) for x in args.concurrency.split(",")):
        n = args.num_requests or max(4, 2 * c)
        rows.append(asyncio.run(run(args.address, n, c, args.max_tokens)))
    print_table(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
