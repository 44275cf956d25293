"""KV handoff between two processes on one GPU, per transport, beside the device's own copy
of the same bytes (``python -m scripts.bench_gpu_handoff``; issue 37).

Layout: the built-in model's (30 layers, block_size 16, 3 KV heads, head_dim 64) in
``--dtype`` (default bfloat16). The receiver is a second process with its own cache, as a
decode worker is; the sender (this process) writes one prompt's blocks, at random free block
ids on both sides, with ``TcpKVTransport.write_blocks``:

- ``cuda-ipc``: direct writes (the receiver's cache opened by CUDA IPC, one copy kernel, the
  control messages on TCP);
- ``host-staged``: the same transport with direct writes off (gather on the device, copy to
  host, socket, host buffer, copy to the device, scatter): the path between nodes.

The floor beside them: ``copy_blocks`` of the same block ids between two caches of this
process (the kernel the IPC path runs) and one contiguous ``copy_`` of the payload's bytes,
both timed with CUDA events. Each figure is the median of ``--repeats`` after two warm-ups.
The target (issue 37) is ``cuda-ipc <= 2 x copy_blocks + 1 ms`` at 2,048 tokens.

Prints a table and writes JSON (``--out``). Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
from pathlib import Path

import torch

from scripts.bench_kv_transfer import time_writes
from services.engine.config import KVCacheLayout

TRANSPORTS = ("cuda-ipc", "host-staged")


def layout(dtype: str) -> KVCacheLayout:
    return KVCacheLayout(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype)


def make_cache(kv: KVCacheLayout, num_blocks: int) -> torch.Tensor:
    shape = (kv.num_layers, 2, num_blocks, kv.block_size, kv.num_kv_heads, kv.head_dim)
    return torch.randn(shape, device="cuda").to(kv.torch_dtype)


def receiver_main(dtype: str, num_blocks: int, metadata_out, stop) -> None:
    """The decode side: a cache, a transport that accepts any write, until told to stop."""
    from services.kv_transfer.tcp import TcpKVTransport

    transport = TcpKVTransport(make_cache(layout(dtype), num_blocks), layout(dtype),
                               host="127.0.0.1", port=0)
    transport.set_notification_handler(lambda note: None)
    metadata_out.put(transport.metadata())
    stop.wait()
    transport.close()


def device_ms(fn, repeats: int) -> float:
    """Median device milliseconds of ``fn()``'s kernels (CUDA events)."""
    times = []
    for i in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", type=Path, default=Path("bench-results/gpu_handoff.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    from kernels.block_copy import copy_blocks
    from services.kv_transfer.tcp import TcpKVTransport

    kv = layout(args.dtype)
    max_blocks = -(-max(args.tokens) // kv.block_size)
    ctx = mp.get_context("spawn")
    metadata_q, stop = ctx.Queue(), ctx.Event()
    receiver_blocks = 3 * max_blocks
    proc = ctx.Process(target=receiver_main, args=(args.dtype, receiver_blocks, metadata_q, stop),
                       daemon=True)
    proc.start()
    metadata = metadata_q.get(timeout=180)
    src, twin = make_cache(kv, 2 * max_blocks), make_cache(kv, receiver_blocks)
    senders = {name: TcpKVTransport(src, kv, host="127.0.0.1", port=0,
                                    direct_writes=name == "cuda-ipc") for name in TRANSPORTS}
    peers = {name: t.add_remote(metadata) for name, t in senders.items()}
    assert senders["cuda-ipc"].direct_peers() == [peers["cuda-ipc"]], "CUDA IPC did not open"
    rng, rows = random.Random(0), []
    try:
        for num_tokens in args.tokens:
            n = -(-num_tokens // kv.block_size)
            local = rng.sample(range(2 * max_blocks), n)
            remote = rng.sample(range(receiver_blocks), n)
            nbytes = n * kv.num_layers * 2 * kv.block_bytes
            row = {"num_tokens": num_tokens, "num_blocks": n, "bytes": nbytes}
            for name, sender in senders.items():
                row[f"{name}_ms"] = statistics.median(time_writes(
                    sender, peers[name], local, remote, args.repeats)) * 1e3
            src_ids = torch.tensor(local, device="cuda")
            dst_ids = torch.tensor(remote, device="cuda")
            row["copy_blocks_ms"] = device_ms(lambda: copy_blocks(src, twin, src_ids, dst_ids),
                                              args.repeats)
            a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            b = torch.empty_like(a)
            row["contiguous_copy_ms"] = device_ms(lambda: b.copy_(a), args.repeats)
            row["target_ms"] = 2 * row["copy_blocks_ms"] + 1.0
            for key in [*(f"{t}_ms" for t in TRANSPORTS), "copy_blocks_ms", "contiguous_copy_ms"]:
                row[key.replace("_ms", "_gb_per_s")] = nbytes / row[key] / 1e6
            rows.append(row)
    finally:
        for sender in senders.values():
            sender.close()
        stop.set()
        proc.join(timeout=30)
    device = torch.cuda.get_device_name()
    print(f"{device}, {args.dtype}, built-in model layout ({kv.num_layers} layers, "
          f"{kv.num_kv_heads} KV heads x {kv.head_dim}), receiver in another process; "
          f"ms (GB/s of KV payload)")
    print(f"{'tokens':>7} {'MB':>7} {'cuda-ipc':>16} {'host-staged':>16} {'copy_blocks':>16} "
          f"{'contiguous':>16} {'target':>8}")
    for r in rows:
        cells = [f"{r[f'{k}_ms']:7.3f} ({r[f'{k}_gb_per_s']:5.0f})"
                 for k in (*TRANSPORTS, "copy_blocks", "contiguous_copy")]
        print(f"{r['num_tokens']:>7} {r['bytes'] / 1e6:>7.1f} " + " ".join(f"{c:>16}" for c in cells)
              + f" {r['target_ms']:>8.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": device, "dtype": args.dtype, "torch": torch.__version__,
                                    "layout": kv.__dict__, "repeats": args.repeats,
                                    "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
