"""Fused per-layer decoder operations for CPUs (``csrc/decode_ops.c``, OpenMP), each beside its
torch reference: residual add + RMSNorm, RoPE of q/k with the KV cache write (after the q/k/v
bias and per-head q/k norms where a model has them), SiLU(gate) * up and GELU(gate) * up.

At a batch-1 decode step each of these is a handful of torch ops whose dispatch costs more than
their arithmetic (576- or 1536-element rows); one C call replaces each group. The kernel is
built on first use like ``kernels.cpu_attention`` (same compiler, flags, cache directory).
Without a compiler ``available()`` is False and callers keep the torch path. The functions take
float32 contiguous CPU tensors (the KV cache may be float16: ``kv_f16``); ``lib()`` hands the
raw functions to a caller that prepares its arguments once per step
(``services.engine.quantized_forward``). Imports nothing of ``services``.

The C code computes in float32 like the references but sums and rounds in another order (and
may fuse multiply-adds): results agree to float32 rounding, not bit for bit.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kernels.cpu_attention import KV_DTYPES, build_shared_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_ops.c"
_ERRORS = {2: "bad shape", 4: "positions: a position is outside the rotary tables",
           5: "slot_mapping: a slot is outside the KV cache"}
_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The loaded kernel (built on first call); ``None``, logged once, when it cannot be built."""
    try:
        so = ctypes.CDLL(str(build_shared_library(SOURCE)))
    except (RuntimeError, OSError) as e:
        log.warning("fused decode ops unavailable, using torch ops: %s", e)
        return None
    so.tandem_add_rmsnorm_f32.argtypes = [_PTR] * 4 + [_I64] * 2 + [_F32, _INT]
    so.tandem_rope_write_kv_f32.argtypes = ([_PTR] * 2 + [_I64] * 5 + [_PTR] * 3 + [_I64]
                                            + [_PTR] * 3 + [_I64] + [_PTR] * 3 + [_F32, _INT, _INT])
    so.tandem_silu_mul_f32.argtypes = [_PTR] * 2 + [_I64] * 2 + [_INT]
    so.tandem_gelu_tanh_mul_f32.argtypes = [_PTR] * 2 + [_I64] * 2 + [_INT]
    so.tandem_argmax_rows_f32.argtypes = [_PTR, _I64, _I64, _PTR, _INT]
    so.tandem_softcap_f32.argtypes = [_PTR, _I64, _I64, _F32, _INT]
    so.tandem_decode_layers_f32.argtypes = (
        [_PTR, _I64] + [_PTR] * 11 + [_I64] * 6 + [_F32] + [_PTR, _I64, _PTR] + [_I64] * 2
        + [_PTR] * 2 + [_I64] * 2 + [_PTR, _F32, _F32] + [_INT] * 4 + [_PTR] * 2 + [_INT])
    return so


# one row of tandem_decode_layers_f32's layer table: addresses (and part counts), in order
LAYER_FIELDS = ("w_in", "w_post", *(f"{m}_{f}" for m in ("qkv", "o", "gate_up", "down")
                                    for f in ("parts", "part_rows", "num_parts")),
                "k_cache", "v_cache", "qkv_bias", "q_norm", "k_norm", "sliding_window",
                "w_attn_out", "w_mlp_out", "cos", "sin")
# the gated MLP's activation, by config.json's hidden_act (the C enum's values)
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


def available() -> bool:
    """Whether the C kernel is built and loaded (building it if needed)."""
    return lib() is not None


def check(rc: int, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` and the cause for a non-zero kernel return code
    (``tandem_decode_layers_f32``: the matmul's codes + 10, the attention's + 20)."""
    if rc == 0:
        return
    if rc >= 20:
        from kernels.cpu_attention import _ERRORS as attention_errors
        raise ValueError(f"{what}: paged_decode_attention: {attention_errors.get(rc - 20, rc)}")
    if rc >= 10:
        from kernels.quant import _ERRORS as matmul_errors
        raise ValueError(f"{what}: quant_matmul: {matmul_errors.get(rc - 10, rc)}")
    raise ValueError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


def _require(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,),
             ) -> ctypes.CDLL:
    so = lib()
    if so is None:
        raise RuntimeError("fused decode ops are not built (no C compiler?)")
    for t in tensors:
        if t.dtype not in dtypes or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("decode ops take contiguous float32 CPU tensors (and a KV cache "
                             "of float32 or float16)")
    return so


def kv_f16(cache: torch.Tensor) -> int:
    """The C functions' ``kv_f16`` flag for a KV cache tensor: 1 for float16, 0 for float32
    (the element types the CPU attention reads, ``cpu_attention.KV_DTYPES``); ``ValueError``
    for any other dtype."""
    if cache.dtype not in KV_DTYPES:
        raise ValueError(f"the CPU KV cache is float32 or float16, not {cache.dtype}")
    return int(cache.dtype == torch.float16)


def add_rmsnorm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor) -> torch.Tensor:
    """``x += y`` (when given, in place), then ``out = weight * (x / sqrt(mean(x^2) + eps))``.

    x, y, out: ``[M, D]`` float32; weight: ``[D]``. Returns ``out``. RMSNorm (Zhang & Sennrich
    2019) in Hugging Face ``LlamaRMSNorm``'s order. Raises ``ValueError`` for bad tensors.
    """
    so = _require(x, weight, out, *(() if y is None else (y,)))
    m, d = x.shape
    check(so.tandem_add_rmsnorm_f32(x.data_ptr(), None if y is None else y.data_ptr(),
                                    weight.data_ptr(), out.data_ptr(), m, d, eps,
                                    torch.get_num_threads()), "add_rmsnorm")
    return out


def add_rmsnorm_reference(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch: ``(x + y, rmsnorm(x + y) * weight)`` as ``reference.rms_norm`` computes it."""
    x = x if y is None else x + y
    return x, weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_write_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                  positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  q_out: torch.Tensor, bias: torch.Tensor | None = None,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  norm_eps: float = 1e-6) -> torch.Tensor:
    """Rotary embedding of a fused q/k/v projection, with the KV cache write (first, where
    given, ``bias`` ``[(num_heads + 2 num_kv_heads) * head_dim]`` added to each row (Qwen2) and
    each q / k head RMS-normalised with ``q_norm`` / ``k_norm`` ``[head_dim]`` (Qwen3)).

    qkv: ``[T, (num_heads + 2 num_kv_heads) * head_dim]`` float32 (q heads, k heads, v heads);
    positions, slot_mapping: ``[T]`` int64; cos, sin: ``[max_positions, head_dim]`` float32
    (``model.RotaryEmbedding``'s tables); k_cache, v_cache: ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` float32, or float16 (each value rounded to nearest even once,
    after the float32 arithmetic). Writes rotated q to ``q_out`` (``[T, num_heads, head_dim]``,
    and returns it), rotated k and v to their slots. RoFormer (Su et al. 2021), Hugging Face's
    rotate-half layout. Raises ``ValueError`` naming ``positions`` / ``slot_mapping`` for an
    index out of range (before anything is written).
    """
    extras = [t for t in (bias, q_norm, k_norm) if t is not None]
    so = _require(qkv, cos, sin, q_out, *extras)
    _require(k_cache, v_cache, dtypes=tuple(KV_DTYPES))
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype}, v_cache {v_cache.dtype}")
    head_dim = cos.shape[1]
    pos, slots = positions.to(torch.int64).contiguous(), slot_mapping.to(torch.int64).contiguous()
    check(so.tandem_rope_write_kv_f32(
        qkv.data_ptr(), q_out.data_ptr(), qkv.shape[0], qkv.shape[1], num_heads, num_kv_heads,
        head_dim, pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        k_cache.numel() // (num_kv_heads * head_dim), *(None if t is None else t.data_ptr()
                                                          for t in (bias, q_norm, k_norm)),
        norm_eps, torch.get_num_threads(), kv_f16(k_cache)), "rope_write_kv")
    return q_out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = silu(gate) * up`` for ``gate_up = [gate | up]`` (``[M, 2F]`` -> ``[M, F]``
    float32; SwiGLU, Shazeer 2020). Returns ``out``. Raises ``ValueError`` for bad tensors."""
    return _gated_mul("tandem_silu_mul_f32", gate_up, out)


def gelu_tanh_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = gelu(gate) * up`` with GELU's tanh form (torch's ``gelu(approximate="tanh")``,
    Gemma's ``gelu_pytorch_tanh``; GeGLU, Shazeer 2020) for ``gate_up = [gate | up]`` (``[M,
    2F]`` -> ``[M, F]`` float32). Returns ``out``. Raises ``ValueError`` for bad tensors."""
    return _gated_mul("tandem_gelu_tanh_mul_f32", gate_up, out)


def _gated_mul(fn: str, gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    so = _require(gate_up, out)
    m, f = out.shape
    if tuple(gate_up.shape) != (m, 2 * f):
        raise ValueError(f"gate_up: expected [{m}, {2 * f}], got {list(gate_up.shape)}")
    check(getattr(so, fn)(gate_up.data_ptr(), out.data_ptr(), m, f, torch.get_num_threads()),
          fn.removeprefix("tandem_").removesuffix("_f32"))
    return out


def softcap_(x: torch.Tensor, softcap: float) -> torch.Tensor:
    """``x = softcap * tanh(x / softcap)`` in place for ``[M, N]`` contiguous float32 CPU
    ``x`` (Gemma 2's final logits); returns ``x``. The tanh is the kernels' (through their exp):
    within a few ulp of torch's, the same bits for a row alone or in a batch. Raises
    ``ValueError`` for bad tensors or a cap that is not positive."""
    so = _require(x)
    check(so.tandem_softcap_f32(x.data_ptr(), x.shape[0], x.shape[1], softcap,
                                torch.get_num_threads()), "softcap")
    return x


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``[M, N]`` logits: int64 ``[M]``, the first index of each
    row's largest value (a NaN counts as largest, as in torch). float32 contiguous CPU tensors
    run the C kernel (torch's argmax is scalar: ~3 ns per logit); others run torch."""
    so = lib()
    if (so is None or logits.dim() != 2 or logits.dtype != torch.float32
            or logits.device.type != "cpu" or not logits.is_contiguous() or logits.shape[1] == 0):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    check(so.tandem_argmax_rows_f32(logits.data_ptr(), logits.shape[0], logits.shape[1],
                                    out.data_ptr(), torch.get_num_threads()), "argmax_rows")
    return out
