"""The quantized model's forward pass as one loop of fused C calls (float32 activations, CPU).

``LlamaForCausalLM``'s module path costs ~4,000 torch ops per decode step of the built-in model
(30 layers), each ~10 us of dispatch on rows of 576 to 1,536 floats, plus ``nn.Module`` calls:
at batch 1 that overhead, not the matmuls, set the step time. Here each layer is eight calls
into C, with every argument prepared once per step:

    x += y; h = rmsnorm(x) w1        kernels.decode_ops.add_rmsnorm (y: last layer's MLP out)
    qkv = h Wqkv^T                   kernels.quant.PreparedMatmul (fused q/k/v)
    q = rope(q); cache <- rope(k), v kernels.decode_ops.rope_write_kv (+ Qwen2's q/k/v bias,
                                     Qwen3's and Gemma 3's per-head q/k norms, first)
    a = attention(q, cache)          kernels.cpu_attention.AttentionPlan (decode and prefill rows;
                                     a sliding window on the layers that have one; Gemma 2's
                                     soft-capped scores)
    o = a Wo^T; x += o; h = rmsnorm(x) w2; gu = h Wgu^T; m = silu(g) u; y = m Wdown^T

Gemma 2 and 3 take the same loop with what differs as data: embeddings times sqrt(hidden) (the
model's ``embed``), every norm's ``1 + w`` folded into its weight, the attention's output and
the MLP's output each RMS-normalised before they join the residual stream (``w_attn_out``,
``w_mlp_out``), GELU's tanh form for SiLU, the attention scale from ``query_pre_attn_scalar``,
and Gemma 3's rotary tables per layer (local and global layers differ).

Same math as the module path, in float32; sums run in another order, so results agree to
float32 rounding, not bit for bit (the float32 ``none`` oracle path never comes here).

Batch invariance: every kernel here computes a token's row in one order whatever the batch,
and a prompt token's attention is the decode step's (the same C kernel, one query at a time),
so a request's hidden states, logits and greedy tokens are the same bits alone or in a batch,
with or without a cached prefix, in one prefill chunk or many, and after a preemption or a
migration recomputes them (tests/unit/test_batch_invariance.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import cpu_attention, decode_ops, quant
from kernels.quant_prepared import PreparedMatmul

from .attention import AttentionMetadata


class QuantizedForward:
    """``forward(input_ids, positions, kv_cache, meta) -> hidden`` of an assembled quantized
    ``LlamaForCausalLM`` (``quantized.assemble_quantized``), reading the model's own weights.

    Shapes as ``LlamaForCausalLM.forward``: input_ids, positions ``[num_tokens]`` int64;
    kv_cache ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`` float32 or float16
    (``--kv-cache-dtype``: written rounded, read widened; activations stay float32); returns
    float32 ``[num_tokens, hidden]`` (after the final norm). Raises ``ValueError`` naming
    ``positions`` or ``slot_mapping`` for an index out of range.
    """

    def __init__(self, model) -> None:
        cfg = model.config
        self.hidden, self.ffn = cfg.hidden_size, cfg.intermediate_size
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.eps = cfg.head_dim, cfg.rms_norm_eps
        first = model.model.layers[0].self_attn
        self.scale, self.softcap = first.scale, first.softcap  # Gemma's query_pre_attn_scalar
        self.activation = decode_ops.ACTIVATIONS[cfg.hidden_act]
        self.max_positions = first.rope.cos.shape[0]
        self.embed, self.norm = model.embed, _norm_weight(model.model.norm)
        self.layers = [(_norm_weight(layer.input_layernorm),
                        PreparedMatmul(layer.self_attn.qkv_proj.parts),
                        PreparedMatmul(layer.self_attn.o_proj.parts),
                        _norm_weight(_pre_mlp_norm(layer)),
                        PreparedMatmul(layer.mlp.gate_up_proj.parts),
                        PreparedMatmul(layer.mlp.down_proj.parts))
                       for layer in model.model.layers]
        self.extras = [_LayerExtras(_weight(layer.self_attn.qkv_proj, "bias"),
                                    _norm_weight(getattr(layer.self_attn, "q_norm", None)),
                                    _norm_weight(getattr(layer.self_attn, "k_norm", None)),
                                    layer.self_attn.sliding_window or 0, *_output_norms(layer),
                                    layer.self_attn.rope.cos.contiguous(),
                                    layer.self_attn.rope.sin.contiguous())
                       for layer in model.model.layers]
        self._ops = decode_ops.lib()
        self._caches: tuple[tuple[int, tuple[int, ...]], list] | None = None
        self._table: tuple[list, torch.Tensor] | None = None
        formats = {mm.fmt_code for layer in self.layers for mm in layer[1:3] + layer[4:]}
        self._one_format = next(iter(formats)) if len(formats) == 1 else None

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        """Whether an assembled quantized model in ``dtype`` can run here: float32 activations,
        and the three C kernels built."""
        return (dtype == torch.float32 and quant.available() and decode_ops.available()
                and cpu_attention.available())

    def _layer_caches(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(k_cache, v_cache)`` views, built once per KV cache tensor."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        if self._caches is None or self._caches[0] != key:
            self._caches = (key, [(kv[0], kv[1]) for kv in kv_cache])
        return self._caches[1]

    def _attention(self, meta: AttentionMetadata, threads: int, kv_dtype: torch.dtype,
                   ) -> dict[int, cpu_attention.AttentionPlan]:
        """The C kernel's plans for this step's tokens, one per sliding window of the layers
        (0: none): decode rows and prefill chunks alike, each token over the cache up to
        itself."""
        return {w: cpu_attention.AttentionPlan.for_tokens(
            meta.block_tables, meta.seq_lens, meta.query_start_loc, self.num_heads,
            self.num_kv_heads, self.scale, threads, w or None, self.softcap, kv_dtype)
            for w in {extra.window for extra in self.extras}}

    def _layer_table(self, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """``[num_layers, len(LAYER_FIELDS)]`` int64 addresses for ``tandem_decode_layers_f32``
        (built once per KV cache tensor); ``None`` when the linears mix block formats."""
        if self._one_format is None:
            return None
        caches = self._layer_caches(kv_cache)
        if self._table is None or self._table[0] is not caches:
            rows = [[w_in.data_ptr(), w_post.data_ptr(), *qkv.addresses(), *o.addresses(),
                     *gu.addresses(), *down.addresses(), k.data_ptr(), v.data_ptr(),
                     *(_address(t) for t in (e.bias, e.q_norm, e.k_norm)), e.window,
                     _address(e.attn_out), _address(e.mlp_out), e.cos.data_ptr(), e.sin.data_ptr()]
                    for (w_in, qkv, o, w_post, gu, down), (k, v), e
                    in zip(self.layers, caches, self.extras)]
            self._table = (caches, torch.tensor(rows, dtype=torch.int64))
        return self._table[1]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        t, threads = input_ids.shape[0], torch.get_num_threads()
        b = _Buffers(self.embed(input_ids).contiguous(), self.hidden, self.ffn,
                     self.num_heads, self.num_kv_heads, self.head_dim)
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        table = self._layer_table(kv_cache) if meta.num_decode_seqs == t else None
        if table is not None:
            self._decode_layers(b, table, pos, slots, meta, kv_cache, threads)
        else:
            self._layers(b, pos, slots, meta, kv_cache, threads)
        return b.out

    def _decode_layers(self, b: _Buffers, table: torch.Tensor, pos: torch.Tensor,
                       slots: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                       threads: int) -> None:
        """Every layer of a decode step in one C call (``tandem_decode_layers_f32``; each
        layer's sliding window is in its row of the table)."""
        plan = cpu_attention.AttentionPlan(meta.block_tables, meta.seq_lens, self.num_heads,
                                           self.num_kv_heads, self.scale, threads,
                                           kv_dtype=kv_cache.dtype)
        num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
        decode_ops.check(self._ops.tandem_decode_layers_f32(
            table.data_ptr(), table.shape[0], *b.pointers(), self.norm.data_ptr(), b.t,
            self.hidden, self.ffn, self.num_heads, self.num_kv_heads, self.head_dim, self.eps,
            pos.data_ptr(), self.max_positions, slots.data_ptr(), num_blocks, block_size,
            plan.tables.data_ptr(), plan.lens.data_ptr(), plan.tables.shape[1], plan.max_len,
            plan.scratch.data_ptr(), self.scale, self.softcap or 0.0, self.activation,
            self._one_format, quant.isa_level(), threads, self.layers[0][1].kernel_address,
            plan.kernel_address, decode_ops.kv_f16(kv_cache)), "decode_layers")

    def _layers(self, b: _Buffers, pos: torch.Tensor, slots: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor, threads: int) -> None:
        """The layers call by call (prefill and mixed steps)."""
        ops, t, heads, kv_heads, d = self._ops, b.t, self.num_heads, self.num_kv_heads, self.head_dim
        plans = self._attention(meta, threads, kv_cache.dtype)
        caches = self._layer_caches(kv_cache)
        kv_f16 = decode_ops.kv_f16(kv_cache)
        num_slots = caches[0][0].shape[0] * caches[0][0].shape[1]
        norm, rope = ops.tandem_add_rmsnorm_f32, ops.tandem_rope_write_kv_f32
        act_mul = (ops.tandem_gelu_tanh_mul_f32 if self.activation else ops.tandem_silu_mul_f32)
        x, h, qkv, q, a, o, gu, act, down, out = b.pointers()
        residual = None  # the previous layer's MLP output, added at the next norm
        for (w_in, qkv_mm, o_mm, w_post, gu_mm, down_mm), (k_cache, v_cache), e in zip(
                self.layers, caches, self.extras):
            decode_ops.check(norm(x, residual, w_in.data_ptr(), h, t, self.hidden, self.eps,
                                  threads), "add_rmsnorm")
            qkv_mm(b.h, b.qkv, threads)
            decode_ops.check(rope(qkv, q, t, b.qkv.shape[1], heads, kv_heads, d, pos.data_ptr(),
                                  e.cos.data_ptr(), e.sin.data_ptr(), e.cos.shape[0],
                                  k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                                  num_slots, _address(e.bias), _address(e.q_norm),
                                  _address(e.k_norm), self.eps, threads, kv_f16),
                             "rope_write_kv")
            plans[e.window](b.q, k_cache, v_cache, b.a)
            o_mm(b.a.view(t, heads * d), b.o, threads)
            if e.attn_out is not None:  # in place
                decode_ops.check(norm(o, None, e.attn_out.data_ptr(), o, t, self.hidden, self.eps,
                                      threads), "add_rmsnorm")
            decode_ops.check(norm(x, o, w_post.data_ptr(), h, t, self.hidden, self.eps, threads),
                             "add_rmsnorm")
            gu_mm(b.h, b.gate_up, threads)
            decode_ops.check(act_mul(gu, act, t, self.ffn, threads), "act_mul")
            down_mm(b.act, b.down, threads)
            if e.mlp_out is not None:
                decode_ops.check(norm(down, None, e.mlp_out.data_ptr(), down, t, self.hidden,
                                      self.eps, threads), "add_rmsnorm")
            residual = down
        decode_ops.check(norm(x, residual, self.norm.data_ptr(), out, t, self.hidden, self.eps,
                              threads), "add_rmsnorm")


class _Buffers:
    """One forward pass's float32 activations; ``x`` (the embeddings) becomes the residual
    stream, ``out`` the final hidden states."""

    def __init__(self, x: torch.Tensor, hidden: int, ffn: int, heads: int, kv_heads: int,
                 head_dim: int) -> None:
        t = self.t = x.shape[0]
        self.x, self.h = x, torch.empty(t, hidden)
        self.qkv = torch.empty(t, (heads + 2 * kv_heads) * head_dim)
        self.q, self.a = torch.empty(t, heads, head_dim), torch.empty(t, heads, head_dim)
        self.o, self.down = torch.empty(t, hidden), torch.empty(t, hidden)
        self.gate_up, self.act = torch.empty(t, 2 * ffn), torch.empty(t, ffn)
        self.out = torch.empty(t, hidden)

    def pointers(self) -> tuple[int, ...]:
        """x, h, qkv, q, a, o, gate_up, act, down, out: the C functions' order."""
        return tuple(b.data_ptr() for b in (self.x, self.h, self.qkv, self.q, self.a, self.o,
                                            self.gate_up, self.act, self.down, self.out))


class _LayerExtras(NamedTuple):
    """What a layer adds to Llama's, each None (0 for the window) where it has none."""
    bias: torch.Tensor | None  # q/k/v projection bias (Qwen2)
    q_norm: torch.Tensor | None  # per-head q and k norm weights (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None
    window: int  # sliding window in tokens (0: none)
    attn_out: torch.Tensor | None  # norm of the attention's output (Gemma)
    mlp_out: torch.Tensor | None  # norm of the MLP's output (Gemma)
    cos: torch.Tensor  # the layer's rotary tables, [max_positions, head_dim]
    sin: torch.Tensor


def _address(t: torch.Tensor | None) -> int:
    """``t``'s data pointer, 0 (C's NULL) for None."""
    return 0 if t is None else t.data_ptr()


def _weight(module, name: str) -> torch.Tensor | None:
    """``module.<name>`` as a contiguous float32 tensor, or None (no module, or no such tensor)."""
    t = getattr(module, name, None)
    return None if t is None else t.detach().float().contiguous()


def _norm_weight(norm) -> torch.Tensor | None:
    """An RMSNorm's scale as the C norm multiplies by it: its weight, or ``1 + weight`` for
    Gemma's form (``model.GemmaRMSNorm``: Hugging Face adds 1 in float32 too); None for None."""
    w = _weight(norm, "weight")
    return w + 1.0 if w is not None and norm.unit_offset else w


def _pre_mlp_norm(layer):
    """The norm before the MLP: Gemma's ``pre_feedforward_layernorm`` (its
    ``post_attention_layernorm`` normalises the attention's output), Llama's
    ``post_attention_layernorm``."""
    gemma = getattr(layer, "pre_feedforward_layernorm", None)
    return layer.post_attention_layernorm if gemma is None else gemma


def _output_norms(layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gemma's norms of the attention's and the MLP's outputs (``_norm_weight``), else None."""
    if getattr(layer, "pre_feedforward_layernorm", None) is None:
        return None, None
    return (_norm_weight(layer.post_attention_layernorm),
            _norm_weight(layer.post_feedforward_layernorm))


# what QuantizedForward computes: Llama's pre-norm gated layer, with the q/k/v bias (Qwen2),
# per-head q/k norms (Qwen3, Gemma 3), sliding windows (Mistral, Phi-3, Gemma) and Gemma's
# norms, GeGLU, scaled embeddings, soft-capped attention and per-layer rotary tables it takes
SERVED = ("llama", "mistral", "phi3", "qwen2", "qwen3", "gemma2", "gemma3_text")


def unsupported_reason(cfg) -> str | None:
    """Why ``QuantizedForward`` cannot run a model of ``cfg`` (``config.ModelConfig``), or None
    for the architectures of ``SERVED``."""
    if cfg.architecture not in SERVED:
        return f"the fused C forward pass does not compute {cfg.architecture}'s layers"
    if cfg.hidden_act not in decode_ops.ACTIVATIONS:
        return f"the fused C forward pass has no {cfg.hidden_act} activation"
    return None
