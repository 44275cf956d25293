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

    slot_mapping: ``[num_tokens]`` int64, ``block_id * block_size + offset``; -1: the token
    is not written (a CUDA graph's padding rows), as the Triton kernels skip it.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if len(slot_mapping) and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm (Zhang and Sennrich, NeurIPS 2019) over the last axis, as Hugging Face's
    ``LlamaRMSNorm``: normalised in float32, cast back to x's dtype, then scaled by ``weight``
    (``[hidden]``). ``unit_offset``: Gemma's form (``GemmaRMSNorm``), scaled by ``1 + weight``
    in float32 before the cast."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = x32 * torch.rsqrt(variance + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, unit_offset: bool = False) -> torch.Tensor:
    """``residual += x`` in place (skipped when ``x`` is None), then ``rms_norm(residual)``;
    x, residual: ``[num_tokens, hidden]``. The sum rounds as Hugging Face's ``residual +
    hidden_states`` does (addition commutes)."""
    if x is not None:
        residual.add_(x)
    return rms_norm(residual, weight, eps, unit_offset)


def qk_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
            num_heads: int, num_kv_heads: int, unit_offset: bool = False) -> None:
    """Per-head RMSNorm of the q and k heads of the fused projection ``qkv`` (``[num_tokens,
    (num_heads + 2 * num_kv_heads) * head_dim]``), in place; q_weight, k_weight: ``[head_dim]``
    (Qwen3's and Gemma 3's ``q_norm`` / ``k_norm``, applied before the rotary embedding)."""
    t, d = qkv.shape[0], q_weight.shape[0]
    heads = qkv.view(t, num_heads + 2 * num_kv_heads, d)
    heads[:, :num_heads] = rms_norm(heads[:, :num_heads], q_weight, eps, unit_offset)
    kv = slice(num_heads, num_heads + num_kv_heads)
    heads[:, kv] = rms_norm(heads[:, kv], k_weight, eps, unit_offset)


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


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU's ``gelu(gate) * up`` with the tanh approximation (Gemma's
    ``gelu_pytorch_tanh``) of ``gate_up`` (``[num_tokens, 2 * ffn]``) -> ``[num_tokens, ffn]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first ``seq_len`` K (or V) rows: ``[seq_len, num_kv_heads, head_dim]``."""
    num_blocks = -(-seq_len // cache.shape[1])
    return cache.index_select(0, block_table[:num_blocks]).flatten(0, 1)[:seq_len]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: Sequence[int], num_decode_seqs: int, scale: float,
    sliding_window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` (``[num_tokens, num_heads, head_dim]``) over each sequence's
    cached K/V (this step's K/V already written). The first ``num_decode_seqs`` sequences have
    exactly one query token. block_tables: ``[num_seqs, max_blocks]`` int; seq_lens:
    ``[num_seqs]`` int, context length after this step; query_start_loc: ``num_seqs + 1``
    offsets into the flattened tokens. ``sliding_window`` W: a query at position p sees keys
    ``p - W < k <= p`` (Mistral, Gemma's local layers; Hugging Face's ``sliding_window``),
    and blocks wholly before every query's window are never read (they may be freed);
    ``softcap`` c: scores become ``c * tanh(scores / c)`` before the softmax (Gemma 2).
    Returns ``[num_tokens, num_heads, head_dim]``.
    """
    out = torch.empty_like(q)
    nd = num_decode_seqs
    if nd:
        out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, block_tables[:nd],
                                          seq_lens[:nd], scale, sliding_window=sliding_window,
                                          softcap=softcap)
    paged_prefill_attention(q, k_cache, v_cache, block_tables[nd:], seq_lens[nd:],
                            query_start_loc[nd:], scale, out=out, sliding_window=sliding_window,
                            softcap=softcap)
    return out


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: Sequence[int], scale: float,
    out: torch.Tensor | None = None, sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Prefill / chunked prefill over the paged cache, one sequence at a time.

    Sequence ``s`` owns rows ``query_start_loc[s]:query_start_loc[s + 1]`` of ``q`` and ``out``
    (absolute offsets: rows outside every sequence are left untouched); its queries are the
    last of its ``seq_lens[s]`` positions and see every earlier position (cached prefix,
    earlier chunks) and themselves, within ``sliding_window`` when given. Shapes, window and
    softcap as in ``paged_attention``.
    """
    out = torch.empty_like(q) if out is None else out
    bs = k_cache.shape[1]
    for i in range(len(query_start_loc) - 1):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if start == end:  # a sequence with no query token this step (a CUDA graph's padding)
            continue
        seq_len = int(seq_lens[i])
        first_block = 0
        if sliding_window is not None:  # the chunk's first query sees nothing before this
            first_block = max(0, seq_len - (end - start) - sliding_window + 1) // bs
        table = block_tables[i, first_block:]
        k = gather_kv(k_cache, table, seq_len - first_block * bs)
        v = gather_kv(v_cache, table, seq_len - first_block * bs)
        out[start:end] = prefill_attention(q[start:end], k, v, scale, sliding_window, softcap,
                                           key_start=first_block * bs)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      sliding_window: int | None = None, softcap: float | None = None,
                      key_start: int = 0) -> torch.Tensor:
    """Causal attention of a chunk of ``n`` queries that are the last ``n`` of ``seq_len``
    positions. q: ``[n, num_heads, head_dim]``; k, v: ``[num_keys, num_kv_heads, head_dim]``,
    the keys of positions ``key_start .. seq_len - 1``. Window and softcap as in
    ``paged_attention``."""
    n, seq_len = q.shape[0], key_start + k.shape[0]
    if n == seq_len and sliding_window is None:
        mask, causal = None, True
    else:  # query j sits at position seq_len - n + j
        pos_q = torch.arange(seq_len - n, seq_len, device=q.device).unsqueeze(1)
        pos_k = torch.arange(key_start, seq_len, device=q.device).unsqueeze(0)
        mask, causal = pos_k <= pos_q, False
        if sliding_window is not None:
            mask &= pos_k > pos_q - sliding_window
    o = _attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                mask, causal, scale, softcap)
    return o[0].transpose(0, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            causal: bool, scale: float, softcap: float | None) -> torch.Tensor:
    """Grouped-query attention of 4-d ``q`` (``[batch, num_heads, n, head_dim]``) over ``k``,
    ``v`` (``[batch, num_kv_heads, num_keys, head_dim]``); mask broadcastable to ``[batch,
    num_heads, n, num_keys]`` (True: visible)."""
    if softcap is None:
        # NOTE: 4-d ([1, heads, n, head_dim]): with 3-d inputs torch's CPU SDPA takes its
        # unfused math path (4.3x slower for a 512-token prompt, 2 threads); 4-d takes flash
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=True)
    # the order of Hugging Face's eager attention (Gemma 2): scale, cap, mask, float32 softmax
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        n, m = scores.shape[-2:]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, bucket_size: int = 8,
    sliding_window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence, batched. q: ``[num_seqs, num_heads, head_dim]``;
    block_tables: ``[num_seqs, max_blocks]``; seq_lens: ``[num_seqs]``. Window and softcap as
    in ``paged_attention``.

    Sequences are sorted by length and attended ``bucket_size`` at a time, each bucket padded
    only to its own longest context. One padded gather over the whole batch copies
    ``num_seqs x max(seq_lens)`` K/V rows, and at a batch of 64 with lengths 100-700 it took
    47 ms a layer on this project's 2-core CPU (2 threads), against 4.8 ms for these buckets.
    """
    if q.shape[0] <= bucket_size:
        return _padded_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                        sliding_window, softcap)
    out = torch.empty_like(q)
    for idx in torch.argsort(seq_lens).split(bucket_size):
        out[idx] = _padded_decode_attention(q[idx], k_cache, v_cache, block_tables[idx],
                                            seq_lens[idx], scale, sliding_window, softcap)
    return out


def _padded_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``paged_decode_attention`` with K/V gathered and padded to the longest sequence (with a
    window: each sequence's gather starts at the block holding its window's first key)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    seq_lens = seq_lens.to(torch.int64)
    first = torch.zeros_like(seq_lens)
    if sliding_window is not None:
        first = (seq_lens - sliding_window).clamp(min=0) // block_size
    last = -(-seq_lens // block_size)  # one past each sequence's last block
    num_blocks = int((last - first).max())
    cols = (first.unsqueeze(1) + torch.arange(num_blocks, device=q.device)).clamp(
        max=block_tables.shape[1] - 1)
    ids = block_tables.gather(1, cols).reshape(-1)
    # [num_seqs, num_kv_heads, num_blocks * block_size, head_dim]; NOTE: index_select, not
    # k_cache[tables]: advanced indexing was 1.8x slower for these gathers on CPU
    k = k_cache.index_select(0, ids).view(num_seqs, -1, *k_cache.shape[2:]).transpose(1, 2)
    v = v_cache.index_select(0, ids).view(num_seqs, -1, *v_cache.shape[2:]).transpose(1, 2)
    pos = first.unsqueeze(1) * block_size + torch.arange(num_blocks * block_size, device=q.device)
    valid = pos < seq_lens.unsqueeze(1)
    if sliding_window is not None:
        valid &= pos >= (seq_lens - sliding_window).unsqueeze(1)
    out = _attend(q.unsqueeze(2), k, v, valid[:, None, None, :], False, scale, softcap)
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
