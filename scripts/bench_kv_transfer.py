"""Time ``KVTransport.write_blocks`` for one prompt's KV blocks, per backend, on one host.

Layout: the default model's (30 layers, block_size 16, 3 KV heads, head_dim 64, float32).
Per backend and prompt length it times contiguous block ids (best case: one region per layer
and K/V) and shuffled ids (worst case: one region per block), prints latency (ms) and
throughput (GB/s, 1e9 bytes/s of KV payload), and writes the results as JSON to ``--out``.
With a prefill time per prompt (``--prefill-ms``, or ``--measure-prefill`` to time the default
model's prefill with ``LLMEngine``) it also prints the share of the TTFT the handoff takes,
``handoff / (prefill + handoff)``. Sender and receiver share one process; NIXL runs over UCX
(shared memory / CMA here; ``UCX_TLS=tcp`` forces TCP).

    python scripts/bench_kv_transfer.py --backends tcp,nixl --measure-prefill
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from services.engine.config import KVCacheLayout
from services.kv_transfer import BACKENDS, create_transport
from services.kv_transfer.nixl import load_nixl

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


def measure_prefill_ms(tokens: list[int], repeats: int = 2) -> list[float]:
    """Milliseconds ``LLMEngine`` (default model, CPU) takes to prefill each prompt length:
    the best of ``repeats`` runs, since the first run of a shape pays one-off costs."""
    from services.engine.engine import EngineConfig, LLMEngine
    from services.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(max_num_batched_tokens=max(tokens), num_kv_blocks=512))
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    rng, best = random.Random(0), {n: float("inf") for n in tokens}
    for i, num_tokens in enumerate(tokens * repeats):
        ids = [rng.randrange(engine.model_config.vocab_size) for _ in range(num_tokens)]
        engine.add_request(engine.make_request(f"prefill-{i}", ids, params))
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        best[num_tokens] = min(best[num_tokens], (time.perf_counter() - start) * 1e3)
    return [best[n] for n in tokens]


def print_table(results: list[dict], prefill_ms: dict[int, float]) -> None:
    print(f"{'backend':>7} {'tokens':>7} {'blocks':>6} {'ids':>10} {'MB':>8} {'median ms':>10} "
          f"{'GB/s':>6}" + (f" {'prefill ms':>10} {'TTFT %':>6}" if prefill_ms else ""))
    for r in results:
        line = (f"{r['backend']:>7} {r['num_tokens']:>7} {r['num_blocks']:>6} "
                f"{r['block_ids']:>10} {r['bytes'] / 1e6:>8.1f} {r['median_ms']:>10.2f} "
                f"{r['gb_per_s']:>6.2f}")
        if prefill_ms:
            prefill = prefill_ms[r["num_tokens"]]
            r["prefill_ms"], r["ttft_share"] = prefill, r["median_ms"] / (prefill + r["median_ms"])
            line += f" {prefill:>10.1f} {100 * r['ttft_share']:>6.1f}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tcp,nixl",
                        help=f"comma-separated, from {', '.join(BACKENDS)}")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--prefill-ms", type=float, nargs="+",
                        help="prefill compute time of each --tokens prompt, for the TTFT share")
    parser.add_argument("--measure-prefill", action="store_true",
                        help="time the default model's prefill of each prompt with LLMEngine")
    parser.add_argument("--out", type=Path, default=Path("bench-results/kv_transfer.json"))
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if unknown := set(backends) - set(BACKENDS):
        parser.error(f"unknown backends {sorted(unknown)}; valid: {', '.join(BACKENDS)}")
    if args.prefill_ms and len(args.prefill_ms) != len(args.tokens):
        parser.error("--prefill-ms needs one value per --tokens value")
    if "nixl" in backends:
        load_nixl()  # fails fast with the install hint
    torch.manual_seed(0)
    results = [r for backend in backends for r in bench(backend, args.tokens, args.repeats)]
    prefill = measure_prefill_ms(args.tokens) if args.measure_prefill else args.prefill_ms
    print_table(results, dict(zip(args.tokens, prefill)) if prefill else {})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"layout": LAYOUT.__dict__, "machine": platform.machine(),
              "cpus": os.cpu_count(), "python": platform.python_version(),
              "torch": torch.__version__, "results": results}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
