"""What the gateway knows of the served model: its name, context length and vocabulary size,
read from the model file's header (GGUF metadata or ``config.json``) without torch or weights."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.engine.gguf_metadata import gguf_field
from services.engine.model_files import DEFAULT_MODEL_NAME, default_model_path
from services.engine.tokenizer import GGUF_STRING_ARRAYS, Tokenizer

HF_DEFAULT_CONTEXT = 2048  # LlamaConfig's max_position_embeddings default


@dataclass(frozen=True)
class ModelCard:
    name: str            # what clients put in ``model``
    max_model_len: int   # context length in tokens (prompt + output)
    vocab_size: int      # token ids are in [0, vocab_size): the rows of the model's logits

    @classmethod
    def load(cls, path: str | os.PathLike) -> ModelCard:
        """The card of a ``.gguf`` file or a Hugging Face directory.

        Raises:
            FileNotFoundError: the file (or ``config.json``) does not exist.
            ValueError: the header lacks the context length or the vocabulary.
        """
        path = Path(path)
        name = served_model_name(path)
        if path.is_dir():
            config_file = path / "config.json"
            if not config_file.is_file():
                raise FileNotFoundError(f"{config_file} does not exist")
            raw = json.loads(config_file.read_text())
            if "vocab_size" not in raw:
                raise ValueError(f"{config_file}: vocab_size is missing")
            return cls(name, int(raw.get("max_position_embeddings", HF_DEFAULT_CONTEXT)),
                       int(raw["vocab_size"]))
        if not path.is_file():
            raise FileNotFoundError(f"model path {path} does not exist")
        from services.engine.gguf_file import GGUFFile

        return cls.from_gguf_reader(GGUFFile(path, read_tensors=False), name)

    @classmethod
    def from_gguf_reader(cls, reader: Any, name: str) -> ModelCard:
        """The card from an open ``gguf.GGUFReader`` or ``gguf_file.GGUFFile``. Raises
        ValueError as ``load``."""
        arch = gguf_field(reader, "general.architecture")
        context = gguf_field(reader, f"{arch}.context_length")
        vocab = gguf_field(reader, f"{arch}.vocab_size")
        if vocab is None:  # a GGUFFile gives the length of a string array it did not read
            tokens = gguf_field(reader, "tokenizer.ggml.tokens", [])
            vocab = tokens if isinstance(tokens, int) else len(tokens)
        if context is None or not vocab:
            raise ValueError(f"GGUF metadata {arch}.context_length or the vocabulary is missing")
        return cls(name, int(context), int(vocab))


def load_model_header(path: str | os.PathLike) -> tuple[ModelCard, Tokenizer]:
    """The card and the tokenizer of a model, its file header parsed once.

    Raises FileNotFoundError / ValueError as ``ModelCard.load`` and ``Tokenizer.load``."""
    path = Path(path)
    if path.is_dir() or path.suffix.lower() != ".gguf":
        return ModelCard.load(path), Tokenizer.load(path)
    if not path.is_file():
        raise FileNotFoundError(f"model path {path} does not exist")
    from services.engine.gguf_file import GGUFFile

    # NOTE: GGUFFile, not gguf.GGUFReader: that one makes a numpy view per vocabulary string
    # and merge (~200k), seconds of CPU at every gateway start
    reader = GGUFFile(path, GGUF_STRING_ARRAYS, read_tensors=False)
    return ModelCard.from_gguf_reader(reader, served_model_name(path)), Tokenizer.from_gguf_reader(reader)


def served_model_name(model: str | os.PathLike) -> str:
    """The name clients use: the default model's, else the file stem or directory name."""
    path = Path(model)
    try:
        if path == default_model_path():
            return DEFAULT_MODEL_NAME
    except FileNotFoundError:
        pass
    return path.stem
