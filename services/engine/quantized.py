"""Serving a GGUF's quantized weights as they are: precision choice, module swap, byte count.

``build_model`` is the engine's one entry: it resolves the ``dtype`` / ``quantization`` settings
for this machine and file, loads the weights (float32 for ``none``; blocks kept as stored, never
expanded to float32, otherwise), and returns the model ready to run.

- ``none``: every weight dense in ``dtype`` (float32 is the token-exact oracle mode).
- ``q4_0`` / ``q4_1`` / ``q8_0``: every linear layer in that block format, run by
  ``kernels.quant.quant_matmul``; tensors already in that format are used in place, others are
  quantized once at load (``gguf.quants.quantize``, llama.cpp's reference quantizers). The
  embedding / tied LM head stays in its file format when that is supported (the default
  model's is Q8_0; an F32 file's is F32), else dense.
- ``f32``: the same, with the linear layers as float32 rows (a GGUF F32 file's, in place): not
  quantized, but run by the same C kernels and fused forward as the block formats, where
  ``none`` runs torch's modules (the token-exact oracle).
- ``auto``: for a GGUF file, its own format when the C kernel is available, the file's
  linear weights are all in one supported format (F32 included) and the fused C forward pass
  serves its architecture (``quantized_forward.unsupported_reason``); Q8_0 (re-encoded once at
  load) when they are block-quantized otherwise: K-quants (Q4_K_M's Q4_K and Q6_K), Q5_0 /
  Q5_1, or several formats; else ``none``; for other checkpoints ``none``. The choice, and
  why, is logged. An explicit format runs any architecture: through the fused C forward pass
  where it serves it, else through the model's own modules with quantized linear layers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels import quant
from kernels.quant import QuantizedWeight

from .config import ModelConfig
from .gguf_file import FLOAT_TYPES
from .host_memory import mapped_zeros
from .loader import load_config, load_model
from .model import LlamaForCausalLM, fuse_projections
from .quantized_loader import (REQUANTIZED, file_weight_formats, load_gguf_quantized,
                               quantize_state_dict)
from .models import model_class
from .quantized_forward import QuantizedForward, unsupported_reason

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "auto")
QUANTIZATIONS = ("none", "auto", *quant.FORMATS)


@dataclass(frozen=True)
class Precision:
    """What a model runs in: activations/KV ``dtype``; ``quantization`` of the linear layers."""

    dtype: str  # "float32" or "bfloat16"
    quantization: str  # "none" or a format of kernels.quant.FORMATS


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16), read from
    ``/proc/cpuinfo``; False where it cannot be read."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(dtype: str, quantization: str, file_formats: set[str], device: str,
                      fused_unsupported: str | None = None) -> Precision:
    """The concrete precision for the settings, this machine and the file's linear-weight
    formats (``file_formats``: names like ``"q4_1"``, ``"f32"``); ``fused_unsupported``: why
    the fused C forward pass cannot serve the model (``auto`` then stays ``none``), or None.

    Raises ``ValueError`` naming ``dtype`` or ``quantization`` for an unknown value, or
    ``quantization`` when a format is asked for on a non-CPU device.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if quantization not in ("none", "auto") and device != "cpu":
        raise ValueError(f"quantization: {quantization!r} runs on CPU only (device {device!r})")
    if quantization == "auto":
        runs = device == "cpu" and quant.available() and fused_unsupported is None
        if len(file_formats) == 1 and file_formats <= quant.FORMATS.keys():
            quantization = next(iter(file_formats)) if runs else "none"
        else:  # several formats, or one without a C kernel (K-quants, Q5_x): re-encoded
            blocks = bool(file_formats) and not file_formats & FLOAT_TYPES
            quantization = REQUANTIZED if runs and blocks else "none"
    if dtype == "auto":
        # NOTE: the kernel's layers compute in int8 (F32: float32) whatever the activation
        # dtype; bf16 elsewhere only pays where the CPU has bf16 instructions (measured 5x
        # slower without them).
        native = device != "cpu" or cpu_has_native_bf16()
        dtype = "bfloat16" if native and quantization == "none" else "float32"
    return Precision(dtype, quantization)


class QuantLinear(nn.Module):
    """``y = x @ W^T (+ bias)`` with ``W`` kept in a GGUF block format (``kernels.quant``).

    x: ``[..., in_features]`` any float dtype; returns x's dtype ``[..., out_features]``.
    bias: ``[out_features]`` (Qwen2's q/k/v), added in x's dtype after the product.
    """

    def __init__(self, *parts: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.parts = parts  # stacked along out_features (fused q/k/v, gate/up), never copied
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quant.quant_matmul(x, self.parts)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, fmt={self.parts[0].fmt}"


class QuantEmbedding(nn.Module):
    """Token embedding rows dequantized on lookup: ids ``[num_tokens]`` int64 ->
    ``[num_tokens, hidden]`` in ``dtype``."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.qweight, self.dtype = weight, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return quant.dequantize_rows(self.qweight, ids).to(self.dtype)


class DenseLinear(nn.Module):
    """A dense linear layer over a given weight tensor (an embedding reused as the LM head)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def build_model(path: str | None, dtype: str, quantization: str, device: str,
                weights: tuple[ModelConfig, dict[str, torch.Tensor]] | None = None,
                ) -> tuple[LlamaForCausalLM, Precision]:
    """Load ``path`` (or use pre-loaded float32 ``weights``) in the resolved precision.

    Returns the model (eval mode, on ``device``) and the precision chosen (logged). Raises what
    ``load_model`` / ``load_gguf_quantized`` raise, and ``ValueError`` for bad settings.
    """
    is_gguf = weights is None and path is not None and str(path).lower().endswith(".gguf")
    formats = file_weight_formats(path) if is_gguf else set()  # not GGUF: auto stays dense
    reason = unsupported_reason(load_config(path)) if is_gguf else None
    precision = resolve_precision(dtype, quantization, formats, device, reason)
    if quantization == "auto" and reason is not None and formats:
        log.info("quantization auto: %s, so the model runs dense (quantization none)", reason)
    elif quantization == "auto" and precision.quantization not in ("none", *formats):
        log.info("quantization auto: no C kernel runs the file's %s blocks as stored: its linear "
                 "layers are re-encoded to %s once, at load", "/".join(sorted(formats)),
                 precision.quantization)
    torch_dtype = getattr(torch, precision.dtype)
    if precision.quantization == "none":
        model_config, state_dict = weights if weights is not None else load_model(path)
        model = model_class(model_config)(model_config, device="meta")
        load_dense(model, state_dict)
        _check_materialized(model)
        model = model.to(device=device, dtype=torch_dtype).eval()
    else:
        if weights is not None:
            model_config, dense, blocks = quantize_state_dict(*weights, precision.quantization)
        else:
            model_config, dense, blocks = load_gguf_quantized(path, precision.quantization)
        model = assemble_quantized(model_config, dense, blocks, torch_dtype)
    log.info("model precision: dtype=%s quantization=%s (asked dtype=%s quantization=%s; file "
             "linear formats %s; kernel %s); resident weights %.1f MB", precision.dtype,
             precision.quantization, dtype, quantization, sorted(formats), quant.isa()
             if precision.quantization != "none" else "-", resident_weight_bytes(model) / 1e6)
    return model, precision


def load_dense(model: LlamaForCausalLM, state_dict: dict[str, torch.Tensor]) -> None:
    """Load Hugging Face-named weights (q/k/v and gate/up stacked by ``fuse_projections``);
    raises ``ValueError`` listing missing/unexpected names."""
    result = model.load_state_dict(fuse_projections(state_dict), strict=False, assign=True)
    tied = model.config.tie_word_embeddings
    missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    if tied:  # assign=True replaced the embedding Parameter: tie the head to the new one
        model.lm_head.weight = model.model.embed_tokens.weight


def assemble_quantized(cfg: ModelConfig, dense: dict[str, torch.Tensor],
                       blocks: dict[str, QuantizedWeight], dtype: torch.dtype) -> LlamaForCausalLM:
    """A model whose linear layers (and, when quantized, embedding and LM head) read ``blocks``.

    ``dense``: the norms, biases (and a dense embedding / LM head when not quantized);
    ``blocks``: Hugging Face names -> quantized weights. q/k/v and gate/up are fused into one
    matmul each (or stored so: Phi-3). In float32 with the C kernels built, and for the
    architectures it serves, the model runs ``QuantizedForward`` (``fused_forward``).
    """
    model = model_class(cfg)(cfg, device="meta")
    dense = dict(dense)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        bias = [dense.pop(p + f"self_attn.{n}_proj.bias", None) for n in "qkv"]
        # NOTE: Q4_1 linears are repacked in 16-row tiles where that is faster (decode_layout)
        attn.qkv_proj = QuantLinear(
            *quant.decode_layout(_stacked(blocks, p + "self_attn.", ("q", "k", "v"), "qkv")),
            bias=torch.cat(bias) if bias[0] is not None else None)
        attn.o_proj = QuantLinear(*quant.decode_layout([blocks[p + "self_attn.o_proj.weight"]]))
        mlp.gate_up_proj = QuantLinear(
            *quant.decode_layout(_stacked(blocks, p + "mlp.", ("gate", "up"), "gate_up")))
        mlp.down_proj = QuantLinear(*quant.decode_layout([blocks[p + "mlp.down_proj.weight"]]))
    embed = blocks.get("model.embed_tokens.weight")
    head = blocks.get("lm_head.weight", embed if cfg.tie_word_embeddings else None)
    if head is not None:  # in 16-row tiles where that is faster; a tied embedding reads them too
        tiled = quant.decode_layout([head])[0]
        embed, head = tiled if head is embed else embed, tiled
        model.lm_head = QuantLinear(head)
    if embed is not None:
        model.model.embed_tokens = QuantEmbedding(embed, dtype)
    rest = {k: v.to(dtype) for k, v in dense.items()}
    if "lm_head.weight" not in rest and head is None:
        rest["lm_head.weight"] = rest["model.embed_tokens.weight"]
    model.load_state_dict(rest, strict=False, assign=True)
    if head is None and cfg.tie_word_embeddings:
        model.lm_head = DenseLinear(model.model.embed_tokens.weight)
    _check_materialized(model)
    pack_resident_blocks(model)
    if QuantizedForward.supports(dtype) and unsupported_reason(cfg) is None:
        model.fused_forward = QuantizedForward(model)
    return model.eval()


def pack_resident_blocks(model: nn.Module) -> int:
    """Copy every quantized weight the model's modules hold (``QuantLinear.parts``,
    ``QuantEmbedding.qweight``; each tensor once, a tied LM head's too) into one buffer of
    ``host_memory.mapped_zeros`` (2 MiB-aligned, huge pages where the OS allows: a decode step
    reads every one of these bytes), each 64-byte aligned, in module order (a forward pass's
    order); then point the modules at the copies. Returns the buffer's bytes (0: none to pack).

    The originals go when nothing else holds them: ``decode_layout``'s repacks, or views of the
    memory-mapped file (whose pages then stay only in the reclaimable page cache)."""
    weights: dict[int, QuantizedWeight] = {}  # by address: a tied weight once, where first held
    for w in _quantized_weights(model):
        if w.data.device.type == "cpu":
            weights.setdefault(w.data.data_ptr(), w)
    offsets, total = {}, 0
    for ptr, w in weights.items():
        offsets[ptr], total = total, total + -(-w.data.numel() // 64) * 64
    if not total:
        return 0
    arena = mapped_zeros(total)
    packed = {}
    for ptr, w in weights.items():
        view = arena[offsets[ptr]:offsets[ptr] + w.data.numel()].view(w.data.shape)
        view.copy_(w.data)
        packed[ptr] = QuantizedWeight(view, w.fmt, w.out_features, w.in_features)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.parts = tuple(packed.get(w.data.data_ptr(), w) for w in m.parts)
        elif isinstance(m, QuantEmbedding):
            m.qweight = packed.get(m.qweight.data.data_ptr(), m.qweight)
    return total


def _stacked(blocks: dict[str, QuantizedWeight], prefix: str, parts: tuple[str, ...],
             fused: str) -> list[QuantizedWeight]:
    """The weights one fused projection stacks: ``{prefix}{fused}_proj`` where the checkpoint
    stores it fused (Phi-3), else ``{prefix}{part}_proj`` for each of ``parts``."""
    if f"{prefix}{fused}_proj.weight" in blocks:
        return [blocks[f"{prefix}{fused}_proj.weight"]]
    return [blocks[f"{prefix}{part}_proj.weight"] for part in parts]


def _check_materialized(model: LlamaForCausalLM) -> None:
    """Raise ``ValueError`` naming a weight the checkpoint did not provide (left on meta)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            raise ValueError(f"checkpoint does not provide {name}")


def _quantized_weights(model: nn.Module) -> list[QuantizedWeight]:
    """The quantized weights the model's modules hold: every ``QuantLinear``'s parts in module
    order (the layers', then the LM head's: what a decode step streams, in its order), then each
    ``QuantEmbedding``'s (a lookup reads a few rows); a tied one appears once per holder."""
    modules = list(model.modules())
    return [*(w for m in modules if isinstance(m, QuantLinear) for w in m.parts),
            *(m.qweight for m in modules if isinstance(m, QuantEmbedding))]


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights the model holds: dense parameters plus quantized blocks, each tensor
    counted once (a tied LM head is not counted twice); the rotary tables are not weights."""
    tensors = [*model.parameters(), *(w.data for w in _quantized_weights(model))]
    unique = {(t.data_ptr(), t.numel() * t.element_size()) for t in tensors}
    return sum(nbytes for _, nbytes in unique)
