"""The quantized model's forward pass as one loop of fused C calls (float32 activations, CPU).

``LlamaForCausalLM``'s module path costs ~4,000 torch ops per decode step of the built-in model
(30 layers), each ~10 us of dispatch on rows of 576 to 1,536 floats, plus ``nn.Module`` calls:
at batch 1 that overhead, not the matmuls, set the step time. Here each layer is eight calls
into C, with every argument prepared once per step:

    x += y; h = rmsnorm(x) w1        kernels.decode_ops.add_rmsnorm (y: last layer's MLP out)
    qkv = h Wqkv^T                   kernels.quant.PreparedMatmul (fused q/k/v)
    q = rope(q); cache <- rope(k), v kernels.decode_ops.rope_write_kv
    a = attention(q, cache)          kernels.cpu_attention.DecodePlan (+ torch for prefill rows)
    o = a Wo^T; x += o; h = rmsnorm(x) w2; gu = h Wgu^T; m = silu(g) u; y = m Wdown^T

Same math as the module path, in float32; sums run in another order, so results agree to
float32 rounding, not bit for bit (the float32 ``none`` oracle path never comes here).
"""
from __future__ import annotations

import torch

from kernels import cpu_attention, decode_ops, quant, reference
from kernels.quant import PreparedMatmul

from .attention import AttentionMetadata


class QuantizedForward:
    """``forward(input_ids, positions, kv_cache, meta) -> hidden`` of an assembled quantized
    ``LlamaForCausalLM`` (``quantized.assemble_quantized``), reading the model's own weights.

    Shapes as ``LlamaForCausalLM.forward``: input_ids, positions ``[num_tokens]`` int64;
    kv_cache ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`` float32; returns
    float32 ``[num_tokens, hidden]`` (after the final norm). Raises ``ValueError`` naming
    ``positions`` or ``slot_mapping`` for an index out of range.
    """

    def __init__(self, model) -> None:
        cfg = model.config
        self.hidden, self.ffn = cfg.hidden_size, cfg.intermediate_size
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.eps = cfg.head_dim, cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        rope = model.model.layers[0].self_attn.rope
        self.cos, self.sin = rope.cos.contiguous(), rope.sin.contiguous()
        self.embed, self.norm = model.model.embed_tokens, model.model.norm.weight.detach()
        self.layers = [(layer.input_layernorm.weight.detach(),
                        PreparedMatmul(layer.self_attn.qkv_proj.parts),
                        PreparedMatmul(layer.self_attn.o_proj.parts),
                        layer.post_attention_layernorm.weight.detach(),
                        PreparedMatmul(layer.mlp.gate_up_proj.parts),
                        PreparedMatmul(layer.mlp.down_proj.parts))
                       for layer in model.model.layers]
        self._ops = decode_ops.lib()
        self._caches: tuple[tuple[int, tuple[int, ...]], list] | None = None

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

    def _attention(self, meta: AttentionMetadata, threads: int):
        """``attend(q, k_cache, v_cache, out)`` for this step: the C kernel for the decode rows,
        the torch reference for prefill chunks (as ``attention.paged_attention`` on CPU)."""
        nd = meta.num_decode_seqs
        plan = cpu_attention.DecodePlan(meta.block_tables[:nd], meta.seq_lens[:nd],
                                        self.num_heads, self.num_kv_heads, self.scale, threads)
        if nd == meta.seq_lens.shape[0]:
            return plan
        tables, lens, starts = meta.block_tables[nd:], meta.seq_lens[nd:], meta.query_start_loc[nd:]

        def attend(q, k_cache, v_cache, out):
            plan(q, k_cache, v_cache, out)  # reads and writes the first nd rows only
            reference.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts,
                                              self.scale, out=out)
            return out
        return attend

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        t, threads, ops = input_ids.shape[0], torch.get_num_threads(), self._ops
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.embed(input_ids).contiguous()  # [t, hidden] float32: the residual stream
        h = torch.empty(t, self.hidden)
        qkv = torch.empty(t, (heads + 2 * kv_heads) * d)
        q, a = torch.empty(t, heads, d), torch.empty(t, heads, d)
        o, down = torch.empty(t, self.hidden), torch.empty(t, self.hidden)
        gate_up, act = torch.empty(t, 2 * self.ffn), torch.empty(t, self.ffn)
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        attend = self._attention(meta, threads)
        caches = self._layer_caches(kv_cache)
        num_slots = caches[0][0].shape[0] * caches[0][0].shape[1]
        norm, rope, silu_mul = (ops.tandem_add_rmsnorm_f32, ops.tandem_rope_write_kv_f32,
                                ops.tandem_silu_mul_f32)
        p = {name: buf.data_ptr() for name, buf in (("x", x), ("h", h), ("qkv", qkv), ("q", q),
                                                      ("o", o), ("gu", gate_up), ("act", act),
                                                      ("down", down))}
        residual = None  # the previous layer's MLP output, added at the next norm
        for (w_in, qkv_mm, o_mm, w_post, gu_mm, down_mm), (k_cache, v_cache) in zip(
                self.layers, caches):
            decode_ops.check(norm(p["x"], residual, w_in.data_ptr(), p["h"], t, self.hidden,
                                  self.eps, threads), "add_rmsnorm")
            qkv_mm(h, qkv, threads)
            decode_ops.check(rope(p["qkv"], p["q"], t, qkv.shape[1], heads, kv_heads, d,
                                  pos.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(),
                                  self.cos.shape[0], k_cache.data_ptr(), v_cache.data_ptr(),
                                  slots.data_ptr(), num_slots, threads), "rope_write_kv")
            attend(q, k_cache, v_cache, a)
            o_mm(a.view(t, heads * d), o, threads)
            decode_ops.check(norm(p["x"], p["o"], w_post.data_ptr(), p["h"], t, self.hidden,
                                  self.eps, threads), "add_rmsnorm")
            gu_mm(h, gate_up, threads)
            decode_ops.check(silu_mul(p["gu"], p["act"], t, self.ffn, threads), "silu_mul")
            down_mm(act, down, threads)
            residual = p["down"]
        out = torch.empty(t, self.hidden)
        decode_ops.check(norm(p["x"], residual, self.norm.data_ptr(), out.data_ptr(), t,
                              self.hidden, self.eps, threads), "add_rmsnorm")
        return out
