"""Weight loaders: a llama.cpp GGUF file or a Hugging Face directory to a float32 state dict.

Both return ``(ModelConfig, state_dict)`` with Hugging Face tensor names
(``model.layers.{i}.self_attn.q_proj.weight``, ...) and torch's ``[out_features, in_features]``
layout, so the model code sees one format whatever the source. The architecture (config.json's
``model_type``, a GGUF file's ``general.architecture``) picks the module of
``services.engine.models`` that reads its config and knows its tensors.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engine.config import ModelConfig

from . import models
from .models import Architecture

StateDict = dict[str, torch.Tensor]
# GGUF tensors that hold configuration (RoPE factors), not weights
_GGUF_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def load_model(path: str | os.PathLike) -> tuple[ModelConfig, StateDict]:
    """Load a checkpoint from a ``.gguf`` file or a Hugging Face directory.

    Returns the config and a state dict of float32 tensors named as in Hugging Face's model
    of that architecture (``lm_head.weight`` only when not tied to the embedding).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is neither a ``.gguf`` file nor a directory, or the checkpoint is
            not of a supported architecture (the message names what is unsupported).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_dir():
        return load_hf_dir(path)
    if path.suffix.lower() == ".gguf":
        return load_gguf(path)
    raise ValueError(f"model path {path} is neither a .gguf file nor a Hugging Face directory")


# --- GGUF ------------------------------------------------------------------------------------

def load_gguf(path: str | os.PathLike) -> tuple[ModelConfig, StateDict]:
    """Load a llama.cpp GGUF file of a supported architecture, dequantized to float32.

    Read with ``gguf_file.GGUFFile``, every tensor through ``gguf.quants.dequantize`` once, then
    put back into Hugging Face's form (``GGUFLayout.to_hf``: Llama's q/k rows from llama.cpp's
    rotary order, Gemma's norms without the one llama.cpp adds): for Llama bit-identical to
    what transformers' own GGUF loader produces.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the architecture or its RoPE scaling is not supported, or a tensor is
            unexpected or missing.
    """
    from .gguf_file import GGUFFile, dequantized

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    layout = GGUFLayout(GGUFFile(path))
    state_dict: StateDict = {}
    for tensor in layout.reader.tensors:
        name = layout.hf_name(tensor.name)
        if name is None:
            continue
        weights = layout.to_hf(name, dequantized(tensor))
        if not weights.flags.writeable or not weights.flags.owndata:
            # NOTE: F32 tensors are read-only views of the memory map: copied to own them
            weights = np.array(weights, dtype=np.float32)
        state_dict[name] = torch.from_numpy(weights)
    check_keys(layout.arch, layout.config, state_dict, source=str(path))
    return layout.config, state_dict


def gguf_config(reader: Any) -> tuple[Architecture, ModelConfig]:
    """The architecture and config of an open ``gguf_file.GGUFFile``: metadata, plus the RoPE
    factor tensors some files carry. Raises ``ValueError`` naming an unsupported architecture
    or setting."""
    from .gguf_file import dequantized

    arch = models.by_gguf_name(reader.field("general.architecture"))
    tensors: dict[str, Callable[[], np.ndarray]] = {
        t.name: (lambda t=t: dequantized(t)) for t in reader.tensors}
    return arch, arch.config_from_gguf(reader.field, tensors)


class GGUFLayout:
    """A GGUF file's tensors in Hugging Face's terms: names through gguf-py's
    ``TensorNameMap`` (llama.cpp's own table of each architecture's Hugging Face names), and
    the architecture's differences in values. ``reader``: a ``gguf_file.GGUFFile``."""

    def __init__(self, reader: Any) -> None:
        import gguf

        self.reader = reader
        self.arch, self.config = gguf_config(reader)
        arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[self.arch.gguf_name]
        names = gguf.get_tensor_name_map(arch_enum, self.config.num_hidden_layers)
        self._hf_names: dict[str, str] = {}
        for hf_name in self.arch.model_cls.checkpoint_tensors(self.config):
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if gguf_name is not None:
                self._hf_names[gguf_name] = hf_name

    def hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face name of tensor ``gguf_name``; None for a tensor that is part of the
        config (RoPE factors). Raises ``ValueError`` for a tensor the model does not have."""
        if gguf_name in _GGUF_CONFIG_TENSORS:
            return None
        if gguf_name not in self._hf_names:
            raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a "
                             f"{self.arch.gguf_name} model")
        return self._hf_names[gguf_name]

    def row_order(self, hf_name: str) -> np.ndarray | None:
        """Permutation taking the stored rows of ``hf_name`` to Hugging Face's, or None."""
        return self.arch.gguf_row_order(hf_name, self.config)

    def to_hf(self, hf_name: str, weights: np.ndarray) -> np.ndarray:
        """A dequantized tensor (float32 ``[out, in]`` or ``[n]``) in Hugging Face's form."""
        order = self.row_order(hf_name)
        if order is not None:
            weights = np.ascontiguousarray(weights[order])
        offset = self.arch.gguf_offset(hf_name)
        if offset:  # NOTE: exact (Sterbenz) for stored values in [0.5, 2], i.e. w in [-0.5, 1]
            weights = weights - np.float32(offset)
        return weights


# --- Hugging Face directories ----------------------------------------------------------------

def load_hf_dir(path: str | os.PathLike) -> tuple[ModelConfig, StateDict]:
    """Load a Hugging Face directory: ``config.json`` plus ``*.safetensors`` shards.

    Sharded checkpoints are read through ``model.safetensors.index.json``; every tensor is
    converted to float32. With tied embeddings any ``lm_head.weight`` in the files is dropped.

    Raises:
        FileNotFoundError: the directory, ``config.json`` or the safetensors files are missing.
        ValueError: ``model_type`` is not supported, a config field is missing or unsupported
            (named in the message), or a tensor is unexpected or missing.
    """
    from safetensors import safe_open

    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model directory")
    arch, config = hf_config(json.loads(config_path.read_text()), path)
    state_dict: StateDict = {}
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # NOTE: old checkpoints save this buffer; the model recomputes it.
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                state_dict[name] = f.get_tensor(name).to(torch.float32)
    check_keys(arch, config, state_dict, source=str(path))
    return config, state_dict


def hf_config(raw: dict[str, Any], path: Path | None = None,
              ) -> tuple[Architecture, ModelConfig]:
    """The architecture and config of a ``config.json`` dict (of directory ``path``, whose
    ``generation_config.json`` may list more end-of-sequence ids). Raises ``ValueError`` naming
    an unsupported ``model_type`` (with the supported list) or field."""
    arch = models.by_model_type(raw.get("model_type"))
    config = arch.config_from_hf(raw)
    generation = path / "generation_config.json" if path is not None else None
    if generation is not None and generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        ids = tuple(dict.fromkeys([*config.eos_token_ids, *eos]))
        config = dataclasses.replace(config, eos_token_id=ids[0] if ids else None,
                                     eos_token_ids=ids)
    return arch, config


def _safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of directory ``path``: the index's shards, or ``*.safetensors``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / shard for shard in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"shard {file} listed in {index.name} is missing")
    return files


def check_keys(arch: Architecture, config: ModelConfig, state_dict: dict[str, Any],
               source: str) -> None:
    """Raise ValueError naming the tensors of ``state_dict`` that ``config`` does not predict."""
    expected = arch.model_cls.checkpoint_tensors(config)
    missing = sorted(expected - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {source} does not match its config: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all)"
        )


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Hyper-parameters only, no weights dequantized: what the gateway needs (context length).

    Raises the same errors as ``load_model``.
    """
    path = Path(path)
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} does not exist")
        return hf_config(json.loads(config_file.read_text()), path)[1]
    if not path.is_file():
        raise FileNotFoundError(f"model path {path} does not exist")
    from .gguf_file import GGUFFile  # NOTE: skips the vocabulary: ~100x faster than GGUFReader

    return gguf_config(GGUFFile(path))[1]
