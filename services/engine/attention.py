"""Paged attention in plain torch: the CPU path, and the reference the Triton kernels match.

Layouts: the KV cache of one layer is ``k_cache``/``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; a batch is ragged and flattened
(``[num_tokens, ...]``, no padding), sequences with a single query token (decode) first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends to, for one step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int64: context length after this step, in tokens
    query_start_loc: list[int]  # num_seqs + 1 offsets into the flattened tokens
    num_decode_seqs: int  # the first num_decode_seqs sequences have exactly one query token


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V (``[num_tokens, num_kv_heads, head_dim]``) into their cache slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first ``seq_len`` K (or V) rows: ``[seq_len, num_kv_heads, head_dim]``."""
    num_blocks = -(-seq_len // cache.shape[1])
    return cache[block_table[:num_blocks]].flatten(0, 1)[:seq_len]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of ``q`` (``[num_tokens, num_heads, head_dim]``) over each sequence's
    cached K/V (this step's K/V already written). Grouped-query heads: query head ``h`` reads
    KV head ``h // (num_heads // num_kv_heads)``. Returns ``[num_tokens, num_heads, head_dim]``.
    """
    out = torch.empty_like(q)
    nd = meta.num_decode_seqs
    if nd:
        out[:nd] = paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale
        )
    locs = meta.query_start_loc
    for i in range(nd, len(locs) - 1):
        start, end = locs[i], locs[i + 1]
        seq_len = int(meta.seq_lens[i])
        k = gather_kv(k_cache, meta.block_tables[i], seq_len)
        v = gather_kv(v_cache, meta.block_tables[i], seq_len)
        out[start:end] = prefill_attention(q[start:end], k, v, scale)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a chunk of ``n`` queries that are the last ``n`` of ``seq_len``
    positions. q: ``[n, num_heads, head_dim]``; k, v: ``[seq_len, num_kv_heads, head_dim]``."""
    n, seq_len = q.shape[0], k.shape[0]
    if n == seq_len:
        mask, causal = None, True
    else:  # query j sits at position seq_len - n + j and sees keys up to it
        pos_q = torch.arange(seq_len - n, seq_len).unsqueeze(1)
        mask, causal = torch.arange(seq_len).unsqueeze(0) <= pos_q, False
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )
    return o.transpose(0, 1)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One query token per sequence, batched. q: ``[num_seqs, num_heads, head_dim]``;
    block_tables: ``[num_seqs, max_blocks]``; seq_lens: ``[num_seqs]``."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // k_cache.shape[1])
    tables = block_tables[:, :num_blocks]
    # [num_seqs, num_kv_heads, max_len, head_dim]
    k = k_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    v = v_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(qg, k.transpose(2, 3)) * scale  # [seqs, kv_heads, group, max_len]
    pad = torch.arange(max_len).unsqueeze(0) >= seq_lens.unsqueeze(1)  # [seqs, max_len]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [seqs, kv_heads, group, head_dim]
    return out.reshape(num_seqs, num_heads, head_dim)
