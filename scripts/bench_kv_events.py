"""What KV events cost and how late they arrive, over a real redis-server.

    python -m scripts.bench_kv_events --batches 2000 --blocks-per-batch 64 --readers 1,4

- engine thread: nanoseconds per recorded event (``KVEventLog.stored``: one deque append), the
  only work events add to the step loop;
- publisher: microseconds per flushed batch (drain, JSON, one pipelined XADD + PEXPIRE), on the
  worker's event loop;
- lag: from the publisher's drain to a reader's ``XREAD`` returning the batch, p50 / p99 / max,
  with 1 and several readers (gateways) following the same stream at once;
- stream size after compaction, in entries and bytes (``MEMORY USAGE``).

Prints a table and writes JSON (``--out``). Measured in one process on one machine: the lag is
loopback Redis plus asyncio scheduling, what a gateway beside its workers sees.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import redis.asyncio as aioredis

from services.engine.kv_events import KVEventLog
from services.state.kv_events import KVEventPublisher, KVEventReader, stream_key
from services.state.redis_server import start_redis_server


def engine_ns_per_event(n: int = 1_000_000) -> float:
    log = KVEventLog()
    t0 = time.perf_counter_ns()
    for h in range(n):
        log.stored(h)
    return (time.perf_counter_ns() - t0) / n


async def run(args) -> dict:
    with start_redis_server() as server:
        client = aioredis.Redis.from_url(server.url)
        log, cached = KVEventLog(), set()
        pub = KVEventPublisher(client, "bench", "m", 16, log, lambda: list(cached),
                                lambda: len(cached), ttl_s=60.0)
        await pub.flush()  # the first snapshot
        out: dict = {"engine_ns_per_event": engine_ns_per_event()}
        for readers in args.readers:
            sent: dict[int, float] = {}
            lags: list[float] = []
            stop = asyncio.Event()

            async def follow(reader: KVEventReader, record: bool) -> None:
                while not stop.is_set():
                    for b in await reader.read(["bench"]):
                        if record and b.seq in sent:
                            lags.append(time.perf_counter() - sent[b.seq])

            tasks = []
            for i in range(readers):
                reader = KVEventReader(aioredis.Redis.from_url(server.url), block_ms=100)
                await reader.read(["bench"])  # caught up: only new entries from here
                tasks.append(asyncio.ensure_future(follow(reader, i == 0)))
            flush_s: list[float] = []
            h = 0
            for _ in range(args.batches):
                for _ in range(args.blocks_per_batch):
                    h += 1
                    cached.add(h)
                    log.stored(h)
                    if len(cached) > args.cache_blocks:
                        cached.discard(h - args.cache_blocks)
                        log.removed(h - args.cache_blocks)
                sent[pub.seq] = time.perf_counter()
                t0 = time.perf_counter()
                await pub.flush()
                flush_s.append(time.perf_counter() - t0)
                await asyncio.sleep(args.gap_s)
            await asyncio.sleep(0.3)
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            lags.sort()
            out[f"readers_{readers}"] = {
                "batches": args.batches, "lag_ms_p50": 1e3 * statistics.median(lags),
                "lag_ms_p99": 1e3 * lags[int(0.99 * (len(lags) - 1))], "lag_ms_max": 1e3 * lags[-1],
                "flush_us_mean": 1e6 * statistics.mean(flush_s),
                "flush_us_p99": 1e6 * sorted(flush_s)[int(0.99 * (len(flush_s) - 1))]}
        key = stream_key("bench")
        out["stream_entries"] = await client.xlen(key)
        out["stream_bytes"] = await client.memory_usage(key)
        await client.aclose()
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_kv_events", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--blocks-per-batch", type=int, default=64, help="stored (and as many removed)")
    p.add_argument("--cache-blocks", type=int, default=4096, help="the cache's size in blocks")
    p.add_argument("--gap-s", type=float, default=0.005, help="seconds between flushes")
    p.add_argument("--readers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--out", default="bench-results/kv_events.json")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    print(f"engine thread: {result['engine_ns_per_event']:.0f} ns per event")
    for readers in args.readers:
        r = result[f"readers_{readers}"]
        print(f"{readers} reader(s): lag p50 {r['lag_ms_p50']:.2f} ms, p99 {r['lag_ms_p99']:.2f} ms, "
              f"max {r['lag_ms_max']:.2f} ms; flush {r['flush_us_mean']:.0f} us mean "
              f"({args.blocks_per_batch} stored + removed per batch)")
    print(f"stream after compaction: {result['stream_entries']} entries, "
          f"{result['stream_bytes']} bytes")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": vars(args), **result}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
