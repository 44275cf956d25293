"""How many KV blocks a worker gets: a fixed count, a fixed memory size, or on a GPU what the
device has left after the model (vLLM's ``gpu_memory_utilization``).

On a GPU, with neither ``num_kv_blocks`` nor ``kv_cache_memory_gib`` set, the engine profiles
its largest step before allocating the cache (``profile_peak_bytes``: a prefill of
``max_num_batched_tokens`` tokens, then logits and a top-p sampling pass over ``max_num_seqs``
rows) and gives the KV cache what is left of ``total * gpu_memory_utilization`` after the
weights, that step's peak activations and the memory the CUDA runtime holds outside torch's
allocator. As in vLLM v1, the fraction is this worker's share of the device whatever else runs
there; ``tandem up`` divides it among workers that share a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CPU_DEFAULT_GIB = 1.0  # kv_cache_memory_gib when unset, off a GPU
GIB = 2**30
# device memory a worker's runtime may hold outside torch's allocator once its CUDA context
# exists (cuBLAS / cuDNN handles, loaded Triton modules): the cap of ``runtime_bytes``
NON_TORCH_BYTES = 512 << 20


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory as the engine measured it, bytes."""

    total: int  # the device's memory
    free_at_start: int  # free before this engine allocated anything
    non_kv: int  # this engine's need without the KV cache: weights, peak step, runtime


def blocks_for_memory(gib: float, block_bytes: int) -> int:
    """KV blocks in ``gib`` GiB (``block_bytes``: one block's K and V over every layer); at
    least one."""
    return max(1, int(gib * GIB) // block_bytes)


def gpu_kv_cache_bytes(mem: DeviceMemory, utilization: float) -> int:
    """Bytes for the KV cache: ``total * utilization`` less ``non_kv``.

    Raises ``ValueError`` naming ``engine.gpu_memory_utilization`` when the device has less
    free memory than that share, or when the share leaves nothing for the KV cache."""
    requested = int(mem.total * utilization)
    if mem.free_at_start < requested:
        raise ValueError(
            f"engine.gpu_memory_utilization: {utilization} of the GPU's {mem.total / GIB:.1f} GiB "
            f"is {requested / GIB:.1f} GiB, but only {mem.free_at_start / GIB:.1f} GiB is free "
            "(other processes hold the rest): lower it, or free the device")
    kv = requested - mem.non_kv
    if kv <= 0:
        raise ValueError(
            f"engine.gpu_memory_utilization: {utilization} of {mem.total / GIB:.1f} GiB leaves no "
            f"room for a KV cache: the model and its largest step need {mem.non_kv / GIB:.2f} "
            "GiB; raise it, or lower engine.max_num_batched_tokens / engine.max_num_seqs, or "
            "use a smaller model")
    return kv


def profile_peak_bytes(model, block_size: int, num_tokens: int, num_seqs: int) -> int:
    """Peak bytes a step of ``num_tokens`` prompt tokens (one sequence) and ``num_seqs`` sampled
    rows allocates on the model's CUDA device, beyond what is allocated before it and beyond
    the throwaway KV cache it writes into."""
    from .attention import AttentionMetadata
    from .config import KVCacheLayout
    from .sampler import apply_top_k_top_p

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cfg = model.config
    layout = KVCacheLayout.of(cfg, block_size, dtype)
    num_blocks = -(-num_tokens // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    kv = torch.empty((layout.num_layers, 2, num_blocks, block_size, layout.num_kv_heads,
                      layout.head_dim), dtype=dtype, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, **i64)
    meta = AttentionMetadata(slot_mapping=positions.clone(),
                             block_tables=torch.arange(num_blocks, **i64).unsqueeze(0),
                             seq_lens=torch.tensor([num_tokens], **i64),
                             query_start_loc=[0, num_tokens], num_decode_seqs=0)
    with torch.inference_mode():
        hidden = model(torch.zeros(num_tokens, **i64), positions, kv, meta)
        rows = hidden[torch.arange(num_tokens - num_seqs, num_tokens, **i64) % num_tokens]
        logits = model.compute_logits(rows)
        apply_top_k_top_p(logits, torch.zeros(num_seqs, **i64),
                          torch.full((num_seqs,), 0.9, device=device))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - kv.numel() * kv.element_size()
    del kv, hidden, rows, logits
    torch.cuda.empty_cache()
    return max(peak, 0)


def measure_gpu(model, block_size: int, num_tokens: int, num_seqs: int,
                free_at_start: int) -> DeviceMemory:
    """``DeviceMemory`` of the model's CUDA device after loading ``model`` (``free_at_start``:
    ``torch.cuda.mem_get_info()[0]`` taken before the model was loaded)."""
    device = next(model.parameters()).device
    peak = profile_peak_bytes(model, block_size, num_tokens, num_seqs)
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    runtime = runtime_bytes(free_at_start - free, allocated, torch.cuda.memory_reserved(device))
    return DeviceMemory(total=total, free_at_start=free_at_start,
                        non_kv=allocated + peak + runtime)


def runtime_bytes(device_used: int, allocated: int, reserved: int) -> int:
    """This process's device memory beyond its live tensors: what the device lost since the
    engine started (``device_used``) less torch's allocations, but at most the allocator's
    cached slack (``reserved - allocated``) plus ``NON_TORCH_BYTES`` (cuBLAS / Triton
    modules). The cap matters where workers share a GPU: `tandem up` starts them at once, and
    a neighbour allocating its KV cache meanwhile must not count as ours (it did: a decode
    worker beside a prefill worker on one H100 got 1,972 blocks instead of ~98,000)."""
    return max(0, min(device_used - allocated, reserved - allocated + NON_TORCH_BYTES))
