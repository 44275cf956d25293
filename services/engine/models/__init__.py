"""The architectures the engine serves, one module each declaring only what differs from Llama
(``model.py`` holds the shared layers): its layers, its config.json and GGUF metadata, its
GGUF tensors' differences (vLLM's ``model_executor/models`` and nano-vllm's ``models`` are the
pattern). ``by_model_type`` / ``by_gguf_name`` find one; anything else is refused with the
supported list."""
from __future__ import annotations

from ..config import ModelConfig
from ..model import LlamaForCausalLM
from . import gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3
from .base import Architecture

__all__ = ["ARCHITECTURES", "Architecture", "by_gguf_name", "by_model_type", "model_class"]

ARCHITECTURES: dict[str, Architecture] = {
    m.ARCHITECTURE.model_type: m.ARCHITECTURE
    for m in (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3)}
_BY_GGUF = {a.gguf_name: a for a in ARCHITECTURES.values() if a.gguf_name}


def by_model_type(model_type: str | None) -> Architecture:
    """The architecture of config.json's ``model_type``. Raises ``ValueError`` naming it and
    the supported ones."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}: supported are "
                         f"{', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def by_gguf_name(name: str | None) -> Architecture:
    """The architecture of a GGUF file's ``general.architecture``. Raises ``ValueError``."""
    if name not in _BY_GGUF:
        raise ValueError(f"unsupported GGUF architecture {name!r}: supported are "
                         f"{', '.join(_BY_GGUF)}")
    return _BY_GGUF[name]


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The model class for ``cfg.architecture``. Raises ``ValueError`` as ``by_model_type``."""
    return by_model_type(cfg.architecture).model_cls
