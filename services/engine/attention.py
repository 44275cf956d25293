"""Paged attention for the model: the engine's metadata contract, dispatched by device.

CUDA tensors run the Triton kernels (``kernels.paged_attention``, ``kernels.cache_ops``). On
CPU, decode attention runs the C kernel of ``kernels.cpu_attention`` (built on first use; the
torch reference when it cannot be built) and everything else the torch references
(``kernels.reference``). There is no flag: the device of the query (or of the new K) decides.

Layouts: the KV cache of one layer is ``k_cache``/``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; a batch is ragged and flattened
(``[num_tokens, ...]``, no padding), sequences with a single query token (decode) first.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import ModuleType

import torch

from kernels import cpu_attention, reference, triton_available


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends to, for one step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int64: context length after this step, in tokens
    query_start_loc: list[int]  # num_seqs + 1 offsets into the flattened tokens
    num_decode_seqs: int  # the first num_decode_seqs sequences have exactly one query token
    # NOTE: device copies derived once per step (shared by every layer), built on first use
    _query_start_loc_t: torch.Tensor | None = field(default=None, init=False, repr=False,
                                                    compare=False)
    _max_query_len: int | None = field(default=None, init=False, repr=False, compare=False)

    def query_start_loc_tensor(self, device: torch.device) -> torch.Tensor:
        """``query_start_loc`` as ``[num_seqs + 1]`` int32 on ``device`` (copied once)."""
        t = self._query_start_loc_t
        if t is None or t.device != device:
            t = torch.tensor(self.query_start_loc, dtype=torch.int32, device=device)
            self._query_start_loc_t = t
        return t

    def set_query_start_loc_tensor(self, t: torch.Tensor) -> None:
        """Give ``query_start_loc_tensor`` a copy already on its device (``[num_seqs + 1]``
        int32)."""
        self._query_start_loc_t = t

    def set_max_query_len(self, n: int) -> None:
        """Bound ``max_query_len`` by ``n`` tokens instead (a CUDA graph's prefill bucket: the
        attention grid must not depend on the step)."""
        self._max_query_len = n

    @property
    def max_query_len(self) -> int:
        """The longest query chunk of the step, in tokens (or the bound set for it)."""
        if self._max_query_len is None:
            locs = self.query_start_loc
            self._max_query_len = max((b - a for a, b in zip(locs, locs[1:])), default=0)
        return self._max_query_len


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V (``[num_tokens, num_kv_heads, head_dim]``) into their cache slots
    (``slot_mapping``: ``[num_tokens]`` int). Triton on CUDA, torch elsewhere."""
    if k.is_cuda:
        _cache_ops().write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    else:
        reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` (``[num_tokens, num_heads, head_dim]``) over each sequence's
    cached K/V (this step's K/V already written). Grouped-query heads: query head ``h`` reads
    KV head ``h // (num_heads // num_kv_heads)``. ``sliding_window`` (tokens a query sees,
    itself included) and ``softcap`` (scores capped by ``c * tanh(s / c)``) as in
    ``kernels.reference.paged_attention``. Returns ``out`` (a new tensor when None): ``[num_tokens,
    num_heads, head_dim]``; rows outside every sequence are not written.
    Triton on CUDA (metadata tensors must be on q's device); on CPU the C decode kernel for
    the decode rows (the torch reference for a softcap, which it does not take) and the torch
    reference for prefill chunks.
    """
    if q.is_cuda:
        return _triton_attention().paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
            meta.query_start_loc_tensor(q.device), meta.max_query_len, meta.num_decode_seqs,
            scale, sliding_window=sliding_window, softcap=softcap, out=out)
    out = torch.empty_like(q) if out is None else out
    nd = meta.num_decode_seqs
    if softcap is None:
        cpu_attention.paged_decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                             meta.seq_lens[:nd], scale, out=out[:nd],
                                             sliding_window=sliding_window)
    elif nd:
        out[:nd] = reference.paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
            sliding_window=sliding_window, softcap=softcap)
    reference.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables[nd:],
                                      meta.seq_lens[nd:], meta.query_start_loc[nd:], scale,
                                      out=out, sliding_window=sliding_window, softcap=softcap)
    return out


@functools.cache
def _triton_attention() -> ModuleType:
    """``kernels.paged_attention``, imported on first CUDA use (triton is optional)."""
    _require_triton()
    import kernels.paged_attention

    return kernels.paged_attention


@functools.cache
def _cache_ops() -> ModuleType:
    _require_triton()
    import kernels.cache_ops

    return kernels.cache_ops


def _require_triton() -> None:
    if not triton_available():
        raise RuntimeError("the CUDA attention path needs triton: pip install 'tandem[gpu]'")
