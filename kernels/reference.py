"""Torch references for every kernel: the engine's CPU path, and what the Triton kernels match.

Layouts (one layer): ``k_cache`` / ``v_cache`` are ``[num_blocks, block_size, num_kv_heads,
head_dim]``; token ``i`` of a sequence lives in slot ``block_table[i // block_size] *
block_size + i % block_size``. A batch is ragged and flattened (``[num_tokens, ...]``, no
padding): sequence ``s`` owns rows ``query_start_loc[s]:query_start_loc[s + 1]``, and those are
the last rows of its ``seq_lens[s]`` positions (the earlier ones are its cached prefix).
Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
Source: PagedAttention (Kwon et al., SOSP 2023), in plain torch. Works on any device.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V (``[num_tokens, num_kv_heads, head_dim]``) into their cache slots.

    slot_mapping: ``[num_tokens]`` int64, ``block_id * block_size + offset``.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang and Sennrich, NeurIPS 2019) as Hugging Face's ``LlamaRMSNorm``:
    normalised in float32, cast back to x's dtype, then scaled by ``weight`` (``[hidden]``)."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``residual += x`` in place (skipped when ``x`` is None), then ``rms_norm(residual)``;
    x, residual: ``[num_tokens, hidden]``. The sum rounds as Hugging Face's ``residual +
    hidden_states`` does (addition commutes)."""
    if x is not None:
        residual.add_(x)
    return rms_norm(residual, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021) in Hugging Face's rotate-half layout:
    ``x * cos + rotate_half(x) * sin``; x ``[num_tokens, num_heads, head_dim]``, cos/sin
    ``[num_tokens, 1, head_dim]`` in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Rotate q and k of the fused projection ``qkv`` (``[num_tokens, (num_heads + 2 *
    num_kv_heads) * head_dim]``) at ``positions`` (cos/sin: ``[max_positions, head_dim]``
    float32 tables), write k and v into their cache slots; returns rotated q ``[num_tokens,
    num_heads, head_dim]``. The tables are gathered and cast to qkv's dtype first, as Hugging
    Face's rotary embedding does."""
    t, d = qkv.shape[0], k_cache.shape[3]
    h, kvh = num_heads, num_kv_heads
    heads = qkv.view(t, h + 2 * kvh, d)
    c, s = cos[positions].unsqueeze(1).to(qkv.dtype), sin[positions].unsqueeze(1).to(qkv.dtype)
    qk = rotate(heads[:, :h + kvh], c, s)  # q and k heads in one pass
    write_kv_cache(qk[:, h:], heads[:, h + kvh:], k_cache, v_cache, slot_mapping)
    return qk[:, :h]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``gate_up`` (``[num_tokens, 2 * ffn]``: gate's columns,
    then up's) -> ``[num_tokens, ffn]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first ``seq_len`` K (or V) rows: ``[seq_len, num_kv_heads, head_dim]``."""
    num_blocks = -(-seq_len // cache.shape[1])
    return cache.index_select(0, block_table[:num_blocks]).flatten(0, 1)[:seq_len]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: Sequence[int], num_decode_seqs: int, scale: float,
) -> torch.Tensor:
    """Causal attention of ``q`` (``[num_tokens, num_heads, head_dim]``) over each sequence's
    cached K/V (this step's K/V already written). The first ``num_decode_seqs`` sequences have
    exactly one query token. block_tables: ``[num_seqs, max_blocks]`` int; seq_lens:
    ``[num_seqs]`` int, context length after this step; query_start_loc: ``num_seqs + 1``
    offsets into the flattened tokens. Returns ``[num_tokens, num_heads, head_dim]``.
    """
    out = torch.empty_like(q)
    nd = num_decode_seqs
    if nd:
        out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, block_tables[:nd],
                                          seq_lens[:nd], scale)
    paged_prefill_attention(q, k_cache, v_cache, block_tables[nd:], seq_lens[nd:],
                            query_start_loc[nd:], scale, out=out)
    return out


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: Sequence[int], scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill / chunked prefill over the paged cache, one sequence at a time.

    Sequence ``s`` owns rows ``query_start_loc[s]:query_start_loc[s + 1]`` of ``q`` and ``out``
    (absolute offsets: rows outside every sequence are left untouched); its queries are the
    last of its ``seq_lens[s]`` positions and see every earlier position (cached prefix,
    earlier chunks) and themselves. Shapes as in ``paged_attention``.
    """
    out = torch.empty_like(q) if out is None else out
    for i in range(len(query_start_loc) - 1):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        seq_len = int(seq_lens[i])
        k = gather_kv(k_cache, block_tables[i], seq_len)
        v = gather_kv(v_cache, block_tables[i], seq_len)
        out[start:end] = prefill_attention(q[start:end], k, v, scale)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a chunk of ``n`` queries that are the last ``n`` of ``seq_len``
    positions. q: ``[n, num_heads, head_dim]``; k, v: ``[seq_len, num_kv_heads, head_dim]``."""
    n, seq_len = q.shape[0], k.shape[0]
    if n == seq_len:
        mask, causal = None, True
    else:  # query j sits at position seq_len - n + j and sees keys up to it
        pos_q = torch.arange(seq_len - n, seq_len, device=q.device).unsqueeze(1)
        mask, causal = torch.arange(seq_len, device=q.device).unsqueeze(0) <= pos_q, False
    # NOTE: 4-d ([1, heads, n, head_dim]): with 3-d inputs torch's CPU SDPA takes its unfused
    # math path (4.3x slower for a 512-token prompt, 2 threads); 4-d takes the flash kernel
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, bucket_size: int = 8,
) -> torch.Tensor:
    """One query token per sequence, batched. q: ``[num_seqs, num_heads, head_dim]``;
    block_tables: ``[num_seqs, max_blocks]``; seq_lens: ``[num_seqs]``.

    Sequences are sorted by length and attended ``bucket_size`` at a time, each bucket padded
    only to its own longest context. One padded gather over the whole batch copies
    ``num_seqs x max(seq_lens)`` K/V rows, and at a batch of 64 with lengths 100-700 it took
    47 ms a layer on this project's 2-core CPU (2 threads), against 4.8 ms for these buckets.
    """
    if q.shape[0] <= bucket_size:
        return _padded_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = torch.empty_like(q)
    for idx in torch.argsort(seq_lens).split(bucket_size):
        out[idx] = _padded_decode_attention(q[idx], k_cache, v_cache, block_tables[idx],
                                            seq_lens[idx], scale)
    return out


def _padded_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """``paged_decode_attention`` with K/V gathered and padded to the longest sequence."""
    num_seqs, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    num_blocks = -(-int(seq_lens.max()) // block_size)
    ids = block_tables[:, :num_blocks].reshape(-1)
    # [num_seqs, num_kv_heads, num_blocks * block_size, head_dim]; NOTE: index_select, not
    # k_cache[tables]: advanced indexing was 1.8x slower for these gathers on CPU
    k = k_cache.index_select(0, ids).view(num_seqs, -1, *k_cache.shape[2:]).transpose(1, 2)
    v = v_cache.index_select(0, ids).view(num_seqs, -1, *v_cache.shape[2:]).transpose(1, 2)
    valid = torch.arange(num_blocks * block_size, device=q.device) < seq_lens.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True)
    return out.view(num_seqs, num_heads, head_dim)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy blocks ``block_ids`` out of a paged cache into a new contiguous buffer.

    cache: ``[..., num_blocks, block_size, num_kv_heads, head_dim]`` (the block axis is the
    fourth from the end: one layer's K, or the whole ``[num_layers, 2, ...]`` cache);
    block_ids: ``[n]`` int. Returns ``[..., n, block_size, num_kv_heads, head_dim]``, in
    ``block_ids`` order. Used to stage KV for transfer and to swap blocks out.
    """
    return cache.index_select(-4, block_ids).contiguous()


def scatter_blocks(buffer: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Inverse of ``gather_blocks``: ``cache[..., block_ids[i], ...] = buffer[..., i, ...]``.

    buffer: ``[..., n, block_size, num_kv_heads, head_dim]``; block_ids: ``[n]`` int, distinct.
    """
    cache.index_copy_(cache.dim() - 4, block_ids, buffer)
