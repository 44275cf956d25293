"""One ragged batch's attention in Triton: the decode kernel for the single-token sequences at
the front, the prefill kernel for the rest. Same contract as ``kernels.reference.paged_attention``
but with device tensors only, so that a step never waits on the host."""
from __future__ import annotations

import torch

from .decode_attention import paged_decode_attention
from .prefill_attention import paged_prefill_attention


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
    num_decode_seqs: int, scale: float, *, sliding_window: int | None = None,
    softcap: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` (``[num_tokens, num_heads, head_dim]``) over each sequence's
    paged K/V (this step's K/V already written).

    block_tables: ``[num_seqs, max_blocks]`` int; seq_lens: ``[num_seqs]`` int;
    query_start_loc: ``[num_seqs + 1]`` int32 row offsets, all on q's device; max_query_len:
    the longest query chunk (tokens); the first ``num_decode_seqs`` sequences have exactly one
    query token (rows ``0 .. num_decode_seqs - 1``); sliding_window and softcap as in
    ``kernels.reference.paged_attention``. Returns ``out`` (a new tensor when None): ``[num_tokens,
    num_heads, head_dim]``, q's dtype; rows outside every sequence are not written.
    """
    out = torch.empty_like(q) if out is None else out
    nd = num_decode_seqs
    if nd:
        paged_decode_attention(q[:nd], k_cache, v_cache, block_tables[:nd], seq_lens[:nd], scale,
                               sliding_window=sliding_window, softcap=softcap, out=out[:nd])
    if len(seq_lens) > nd:
        paged_prefill_attention(q, k_cache, v_cache, block_tables[nd:], seq_lens[nd:],
                                query_start_loc[nd:], max_query_len, scale,
                                sliding_window=sliding_window, softcap=softcap, out=out)
    return out
