"""GPU kernel benchmarks: paged decode attention bandwidth, prefill attention throughput.

Decode: achieved HBM bandwidth (K/V bytes read / time, 1e9 bytes/s, and % of the device's
peak) at each batch x context, against ``torch.nn.functional.scaled_dot_product_attention``
on K/V already gathered into dense ``[batch, num_kv_heads, context, head_dim]`` tensors.
Prefill: TFLOP/s of causal attention (4 * heads * head_dim * attended query-key pairs), whole
prompts (against SDPA ``is_causal``) and 512-token chunks after a cached prefix;
``--prefill-configs`` times several tile shapes / warps / pipeline stages side by side on the
same inputs (a sweep to choose the defaults with figures); ``--split-programs`` and
``--merge`` do the same for decode's stage-1 grid and where the splits are merged (a second
kernel, or stage 1's last program of each row). Times are medians of
``triton.testing.do_bench`` (L2 flushed between runs); decode also replayed from a CUDA graph
(``graph GB/s``: no host launch cost, as the engine runs it). Needs a CUDA device.

    python -m kernels.bench --out bench-results/kernels.json [--shape llama3-8b] [--peak-gbps N]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# (substring of torch.cuda.get_device_name(), peak HBM GB/s), first match wins; vendor specs
PEAK_HBM_GBPS = [
    ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
    ("L40S", 864.0), ("L4", 300.0), ("A10G", 600.0), ("A10", 600.0), ("RTX 4090", 1008.0),
]
# name -> (num_heads, num_kv_heads, head_dim)
SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128)}
BLOCK_SIZE = 16
CHUNK = 512  # prefill chunk after a cached prefix, tokens


def peak_hbm_gbps(device_name: str) -> float | None:
    """The device's peak HBM bandwidth (GB/s) from ``PEAK_HBM_GBPS``, or None if unknown."""
    return next((gbps for key, gbps in PEAK_HBM_GBPS if key in device_name), None)


def time_ms(fn, device: torch.device) -> float:
    """Median milliseconds of ``fn()``: ``triton.testing.do_bench`` on CUDA; a few plain runs
    elsewhere (``--smoke``: checks this script, not the speed)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_time_ms(fn, device: torch.device, reps: int = 20) -> float | None:
    """Milliseconds of one ``fn()`` as a CUDA graph replays it (how the engine runs decode
    steps): ``reps`` calls, each after an L2 flush, in one graph, less a graph of the flushes
    alone, medians of 5 replays each. No host launch cost is in it, where ``time_ms`` (one
    Python call per timing) has what the flush does not hide. None off CUDA."""
    if device.type != "cuda":
        return None
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled and warm before the capture, as torch asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)

    def replay_ms(with_fn: bool) -> float:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()
        times = []
        for _ in range(5):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return max(replay_ms(True) - replay_ms(False), 0.0) / reps


def paged_cache(batch: int, context: int, shape: tuple[int, int, int], dtype: torch.dtype,
                device: torch.device):
    """K/V caches holding ``batch`` sequences of ``context`` tokens in shuffled blocks, their
    block tables ``[batch, ceil(context / BLOCK_SIZE)]`` and seq_lens ``[batch]``."""
    _, num_kv_heads, head_dim = shape
    blocks_per_seq = -(-context // BLOCK_SIZE)  # the last block partly filled
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device=device).to(dtype)
    v_cache = torch.randn(cache_shape, device=device).to(dtype)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    return k_cache, v_cache, tables, seq_lens


def decode_row(batch: int, context: int, shape, dtype, device, peak: float | None,
               table_width: int | None = None, split_programs: int = 0,
               merge: str = "kernel") -> dict:
    """One decode case: Triton on the paged cache vs SDPA on the gathered dense K/V.
    ``table_width`` (tokens): the block table as wide as that, zero-padded past each sequence's
    blocks, as a CUDA graph passes the model's full width; the grid gets that width's splits.
    ``split_programs``: stage 1's programs per (sequence, KV head) (0: the kernel's choice,
    ``choose_split_programs``). ``merge``: ``kernel`` (stage 2 launched) or ``fused`` (stage 1's
    last program of each row merges it)."""
    from kernels.decode_attention import (choose_num_splits, choose_split_programs,
                                          default_block_n, paged_decode_attention)

    num_heads, num_kv_heads, head_dim = shape
    k_cache, v_cache, tables, seq_lens = paged_cache(batch, context, shape, dtype, device)
    width = max(context, table_width or 0)
    wide = torch.zeros(batch, width // BLOCK_SIZE, dtype=tables.dtype, device=device)
    wide[:, :tables.shape[1]] = tables
    q = torch.randn(batch, num_heads, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    run = lambda: paged_decode_attention(q, k_cache, v_cache, wide, seq_lens, scale,  # noqa: E731
                                         split_programs=split_programs or None,
                                         fused_merge=merge == "fused")
    triton_ms = time_ms(run, device)
    graph_ms = graph_time_ms(run, device)
    k = k_cache[tables].flatten(1, 2).transpose(1, 2).contiguous()  # [batch, kv_heads, ctx, D]
    v = v_cache[tables].flatten(1, 2).transpose(1, 2).contiguous()
    q4 = q.unsqueeze(2)  # [batch, heads, 1, head_dim]
    sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)  # noqa: E731
    sdpa_ms = time_ms(sdpa, device)
    got = run()
    kv_bytes = k_cache.numel() * k_cache.element_size() * 2
    gbps = kv_bytes / triton_ms / 1e6
    splits = choose_num_splits(width, default_block_n(head_dim))
    return {
        "batch": batch, "context": context, "kv_bytes": kv_bytes,
        "table_width": width, "num_splits": splits,
        "split_programs": min(splits, split_programs or choose_split_programs(
            batch * num_kv_heads, splits, device)),
        "merge": merge,
        "triton_ms": triton_ms, "sdpa_ms": sdpa_ms,
        "triton_gbps": gbps, "sdpa_gbps": kv_bytes / sdpa_ms / 1e6,
        "triton_pct_peak": 100 * gbps / peak if peak else None,
        "graph_ms": graph_ms,  # replayed from a CUDA graph: no launch cost (graph_time_ms)
        "graph_gbps": kv_bytes / graph_ms / 1e6 if graph_ms else None,
        "max_abs_diff": (got.float() - sdpa().squeeze(2).float()).abs().max().item(),
    }


def bench_decode(batches, contexts, shape, dtype, device, peak, max_gib: float,
                 table_width: int | None = None, split_programs=(0,),
                 merges=("kernel",)) -> list[dict]:
    rows = []
    itemsize = torch.empty((), dtype=dtype).element_size()
    for context in contexts:
        for batch in batches:
            kv_bytes = 2 * batch * context * shape[1] * shape[2] * itemsize
            if 2 * kv_bytes > max_gib * 2**30:  # the paged cache and SDPA's gathered copy
                print(f"skip decode batch {batch} context {context}: over --max-gib",
                      file=sys.stderr)
                continue
            rows += [decode_row(batch, context, shape, dtype, device, peak, table_width, n, m)
                     for n in split_programs for m in merges]
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


TUNING_KEYS = ("block_m", "block_n", "num_warps", "num_stages")


def parse_prefill_config(text: str) -> dict[str, int]:
    """``--prefill-configs`` entry ``BMxBNxWxS`` (rows and keys per tile, warps, pipeline
    stages; 0: the wrapper's default) -> ``paged_prefill_attention``'s tuning keywords;
    ``default`` -> none. Raises ``ValueError`` on another form."""
    if text == "default":
        return {}
    parts = text.split("x")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ValueError(f"prefill config {text!r} is not BMxBNxWxS (e.g. 128x64x8x3) or default")
    return {k: int(v) for k, v in zip(TUNING_KEYS, parts) if int(v)}


def prefill_rows(mode: str, context: int, chunk: int, batch: int, shape, dtype, device,
                 configs: list[dict[str, int]]) -> list[dict]:
    """``batch`` sequences whose last ``chunk`` of ``context`` tokens are the queries: one row
    per tuning config (``parse_prefill_config``), on the same inputs; ``max_abs_diff`` is each
    config's output against the first's, and a config Triton cannot launch (e.g. out of
    shared memory) gets its error instead of a time."""
    from kernels.prefill_attention import paged_prefill_attention

    num_heads, num_kv_heads, head_dim = shape
    k_cache, v_cache, tables, seq_lens = paged_cache(batch, context, shape, dtype, device)
    q = torch.randn(batch * chunk, num_heads, head_dim, device=device).to(dtype)
    locs = torch.arange(0, batch * chunk + 1, chunk, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    pairs = batch * (chunk * (context - chunk) + chunk * (chunk + 1) // 2)
    flops = 4 * num_heads * head_dim * pairs
    base = {"mode": mode, "context": context, "chunk": chunk, "batch": batch}
    if mode == "prompt":  # the same work as one dense causal attention per sequence
        dense_q = q.view(batch, chunk, num_heads, head_dim).transpose(1, 2)
        kv = torch.randn(batch, num_kv_heads, chunk, head_dim, device=device).to(dtype)
        sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(
            dense_q, kv, kv, is_causal=True, scale=scale, enable_gqa=True), device)
        base |= {"sdpa_ms": sdpa_ms, "sdpa_tflops": flops / sdpa_ms / 1e9}
    rows, first = [], None
    for config in configs:
        run = lambda: paged_prefill_attention(  # noqa: E731
            q, k_cache, v_cache, tables, seq_lens, locs, chunk, scale, **config)
        row = base | {k: config.get(k) for k in TUNING_KEYS}
        try:
            got = run()
            ms = time_ms(run, device)
        except Exception as exc:  # noqa: BLE001 - a sweep reports a config it cannot run
            rows.append(row | {"error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        first = got if first is None else first
        rows.append(row | {"triton_ms": ms, "triton_tflops": flops / ms / 1e9,
                           "max_abs_diff": (got.float() - first.float()).abs().max().item()})
    return rows


def bench_prefill(lengths, shape, dtype, device, tokens_per_batch: int,
                  configs: list[dict[str, int]] | None = None) -> list[dict]:
    rows = []
    for length in lengths:
        cases = [("prompt", length)] + ([("chunk", CHUNK)] if length > CHUNK else [])
        for mode, chunk in cases:
            batch = max(1, tokens_per_batch // chunk)
            rows += prefill_rows(mode, length, chunk, batch, shape, dtype, device,
                                 configs or [{}])
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def print_tables(decode: list[dict], prefill: list[dict]) -> None:
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'progs':>5} {'merge':>6} "
          f"{'triton GB/s':>12} {'% peak':>7} {'graph GB/s':>11} {'sdpa GB/s':>10} "
          f"{'max|diff|':>10}")
    for r in decode:
        pct = f"{r['triton_pct_peak']:.0f}" if r["triton_pct_peak"] is not None else "?"
        graph = f"{r['graph_gbps']:.0f}" if r.get("graph_gbps") else "-"
        print(f"{r['batch']:>6} {r['context']:>8} {r['num_splits']:>6} {r['split_programs']:>5} "
              f"{r['merge']:>6} {r['triton_gbps']:>12.0f} {pct:>7} {graph:>11} "
              f"{r['sdpa_gbps']:>10.0f} {r['max_abs_diff']:>10.1e}")
    print(f"\n{'mode':>6} {'context':>8} {'chunk':>6} {'batch':>6} {'config':>14} "
          f"{'triton TFLOP/s':>15} {'sdpa TFLOP/s':>13}")
    for r in prefill:
        sdpa = f"{r['sdpa_tflops']:.1f}" if "sdpa_tflops" in r else "-"
        config = ("x".join(str(r[k] or 0) for k in TUNING_KEYS)
                  if any(r[k] for k in TUNING_KEYS) else "default")
        tflops = f"{r['triton_tflops']:.1f}" if "triton_tflops" in r else r["error"][:40]
        print(f"{r['mode']:>6} {r['context']:>8} {r['chunk']:>6} {r['batch']:>6} {config:>14} "
              f"{tflops:>15} {sdpa:>13}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--prefill-lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--prefill-tokens", type=int, default=16384,
                        help="query tokens per prefill batch")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="peak HBM bandwidth, GB/s (default: from the device name)")
    parser.add_argument("--max-gib", type=float, default=40.0, help="skip larger decode cases")
    parser.add_argument("--table-width", type=int, default=None,
                        help="decode block tables this many tokens wide (e.g. max_model_len, as "
                             "CUDA graphs pass them); default: each context's own width")
    parser.add_argument("--split-programs", type=int, nargs="+", default=[0],
                        help="decode: stage 1's programs per (sequence, KV head) to time side "
                             "by side (0: the kernel's choice)")
    parser.add_argument("--merge", nargs="+", choices=["kernel", "fused"], default=["kernel"],
                        help="decode: the merge kernel, or stage 1 merging (side by side)")
    parser.add_argument("--prefill-configs", nargs="+", default=["default"],
                        help="prefill tuning configs to time side by side, each BMxBNxWxS (rows "
                             "and keys per tile, warps, stages; 0: default) or 'default'")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU in the Triton interpreter: checks the script")
    parser.add_argument("--out", type=Path, default=Path("bench-results/kernels.json"))
    args = parser.parse_args()
    try:
        configs = [parse_prefill_config(c) for c in args.prefill_configs]
    except ValueError as exc:
        parser.error(str(exc))
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        sys.exit("kernels.bench needs a CUDA device (torch.cuda.is_available() is False); "
                 "--smoke checks the script on CPU")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    peak = args.peak_gbps or peak_hbm_gbps(name)
    if peak is None:
        print(f"unknown peak bandwidth of {name!r}: pass --peak-gbps", file=sys.stderr)
    dtype, shape = getattr(torch, args.dtype), SHAPES[args.shape]
    torch.manual_seed(0)  # the same inputs every run: rows compare across runs, not only within
    decode = bench_decode(args.batches, args.contexts, shape, dtype, device, peak, args.max_gib,
                          args.table_width, args.split_programs, args.merge)
    prefill = bench_prefill(args.prefill_lengths, shape, dtype, device, args.prefill_tokens,
                            configs)
    print(f"{name}, peak {peak} GB/s, {args.shape} {shape}, {args.dtype}\n")
    print_tables(decode, prefill)
    import triton

    report = {"device": name, "peak_gbps": peak, "shape": args.shape, "heads": shape,
              "dtype": args.dtype, "block_size": BLOCK_SIZE, "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(),
              "decode": decode, "prefill": prefill}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")

if __name__ == "__main__":
    main()
