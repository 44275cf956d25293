"""Time ``KVTransport.write_blocks`` for one prompt's KV blocks over 127.0.0.1.

Layout: the default model's (30 layers, block_size 16, 3 KV heads, head_dim 64, float32).
Per prompt length it times contiguous block ids (best case: one region per layer and K/V) and
shuffled ids (worst case: one region per block), prints latency (ms) and throughput (GB/s,
1e9 bytes/s of KV payload), and writes the results as JSON to ``--out``.

    python scripts/bench_kv_transfer.py --out bench-results/kv_transfer.json
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from services.engine.config import KVCacheLayout
from services.kv_transfer import BACKENDS, create_transport

LAYOUT = KVCacheLayout(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")


def make_cache(num_blocks: int) -> torch.Tensor:
    shape = (LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads,
             LAYOUT.head_dim)
    return torch.randn(shape, dtype=LAYOUT.torch_dtype)


def time_writes(sender, peer: str, local_ids: list[int], remote_ids: list[int],
                repeats: int) -> list[float]:
    """Seconds per ``write_blocks`` call, after two warm-up calls."""
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        sender.write_blocks(peer, local_ids, remote_ids, f"req-{i}".encode(), timeout_s=60.0)
        times.append(time.perf_counter() - start)
    return times[2:]


def bench(backend: str, tokens: list[int], repeats: int) -> list[dict]:
    max_blocks = -(-max(tokens) // LAYOUT.block_size)
    sender = create_transport(backend, make_cache(max_blocks * 2), LAYOUT, host="127.0.0.1",
                              port=0)
    receiver = create_transport(backend, make_cache(max_blocks * 3), LAYOUT, host="127.0.0.1",
                                port=0)
    receiver.set_notification_handler(lambda note: None)
    rng = random.Random(0)
    results = []
    try:
        peer = sender.add_remote(receiver.metadata())
        for num_tokens in tokens:
            n = -(-num_tokens // LAYOUT.block_size)
            shuffled = (rng.sample(range(max_blocks * 2), n), rng.sample(range(max_blocks * 3), n))
            for ids_kind, (local, remote) in (("contiguous", (list(range(n)), list(range(n, 2 * n)))),
                                              ("shuffled", shuffled)):
                times = time_writes(sender, peer, local, remote, repeats)
                nbytes = n * LAYOUT.num_layers * 2 * LAYOUT.block_bytes
                median = statistics.median(times)
                results.append({
                    "backend": backend, "num_tokens": num_tokens, "num_blocks": n,
                    "block_ids": ids_kind, "bytes": nbytes, "repeats": repeats,
                    "median_ms": median * 1e3, "min_ms": min(times) * 1e3,
                    "max_ms": max(times) * 1e3, "gb_per_s": nbytes / median / 1e9,
                })
    finally:
        sender.close()
        receiver.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, default="tcp")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench-results/kv_transfer.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    results = bench(args.backend, args.tokens, args.repeats)
    print(f"{'tokens':>7} {'blocks':>6} {'ids':>10} {'MB':>8} {'median ms':>10} {'GB/s':>6}")
    for r in results:
        print(f"{r['num_tokens']:>7} {r['num_blocks']:>6} {r['block_ids']:>10} "
              f"{r['bytes'] / 1e6:>8.1f} {r['median_ms']:>10.2f} {r['gb_per_s']:>6.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"layout": LAYOUT.__dict__, "machine": platform.machine(),
              "python": platform.python_version(), "torch": torch.__version__,
              "results": results}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
