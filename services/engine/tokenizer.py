"""Text <-> token ids, chat templates and streaming detokenization.

The tokenizer is rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata (the way llama.cpp
reads it: byte-level BPE for ``gpt2`` files, SentencePiece BPE for ``llama`` ones) or loaded
from a Hugging Face ``tokenizer.json``; all end up as one ``tokenizers.Tokenizer`` (the Rust
library), so encode/decode run at native speed.
"""
from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from services.engine.gguf_metadata import gguf_field

# the GGUF string arrays the tokenizer reads (``gguf_file.GGUFFile(read_string_arrays=...)``)
GGUF_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's llama_token_type values in tokenizer.ggml.token_type
_SPACE = "\u2581"  # SentencePiece's whitespace, "▁"
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3 split (Llama 3 files say "llama-bpe").
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 split (Qwen2, Qwen2.5, Qwen3 files say "qwen2"): Llama 3's
# with every digit on its own, as Qwen2's tokenizer.json.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """The pre-tokenizer for ``tokenizer.ggml.pre`` and whether BPE should ``ignore_merges``.

    ``smollm`` follows SmolLM2's own ``tokenizer.json`` and llama.cpp (``\\p{N}`` split first):
    each digit is its own pre-token, then the GPT-2 regex. ``gpt2`` and ``default`` use the
    GPT-2 regex alone. ``llama-bpe`` is Llama 3's split, ``qwen2`` Qwen's (digits one by one). NOTE: llama.cpp's ``default`` adds extra punctuation/digit splits on top;
    files converted from a Hugging Face tokenizer name their real pre-tokenizer instead.

    Raises:
        ValueError: ``pre`` is not one of ``smollm``, ``gpt2``, ``default``, ``llama-bpe``,
            ``qwen2``.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "default"):
        return byte_level, False
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), False
    if pre in ("llama-bpe", "qwen2"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if pre == "llama-bpe" else _QWEN2_SPLIT),
                                     behavior="isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex]), pre == "llama-bpe"
    raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}: expected smollm, gpt2, default, "
                     "llama-bpe or qwen2")


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:
    """Compile a chat template the way transformers' ``_compile_jinja_template`` does."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """A byte-level BPE tokenizer with its special ids and chat template.

    Build one with ``from_gguf``, ``from_hf_dir`` or ``load``. Token ids are ints in
    ``[0, vocab_size)``; text is ``str``. BOS/EOS are added by ``encode`` only where the source
    says so (``tokenizer.ggml.add_bos_token`` / ``add_eos_token``, or ``tokenizer.json``'s
    post-processor).
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_id: int | None, chat_template: str | None) -> None:
        self.backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self.chat_template = chat_template
        self._special_ids = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Tokenizer of a ``.gguf`` file or a Hugging Face directory (like ``load_model``).

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ValueError: ``path`` is neither a ``.gguf`` file nor a directory.
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer path {path} does not exist")
        if path.is_dir():
            return cls.from_hf_dir(path)
        if path.suffix.lower() == ".gguf":
            return cls.from_gguf(path)
        raise ValueError(f"tokenizer path {path} is neither a .gguf file nor a Hugging Face directory")

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Rebuild the tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata.

        ``tokenizer.ggml.model`` ``gpt2``: byte-level BPE (vocab ``tokenizer.ggml.tokens``,
        merges ``tokenizer.ggml.merges``), the pre-tokenizer ``tokenizer.ggml.pre`` names, a
        ByteLevel decoder. ``llama``: SentencePiece BPE (``_gguf_spm``: Llama 2, Mistral,
        Gemma, Phi-3 files). Either way control tokens become special added tokens (matched
        whole in text) and user-defined ones plain added tokens.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ValueError: ``tokenizer.ggml.model`` is not ``gpt2`` or ``llama``, or
                ``tokenizer.ggml.pre`` is unsupported (the message names the value).
        """
        from services.engine.gguf_file import GGUFFile  # NOTE: ~10x faster than gguf.GGUFReader

        if not Path(path).is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return cls.from_gguf_reader(GGUFFile(path, GGUF_STRING_ARRAYS, read_tensors=False))

    @classmethod
    def from_gguf_reader(cls, reader: Any) -> Tokenizer:
        """``from_gguf`` over an open ``gguf.GGUFReader`` or ``gguf_file.GGUFFile`` (opened with
        ``GGUF_STRING_ARRAYS``): callers that need more of the header read it once. Raises
        ValueError as ``from_gguf``."""
        kind = gguf_field(reader, "tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ValueError(f"unsupported tokenizer.ggml.model {kind!r}: 'gpt2' (byte-level BPE) "
                             "or 'llama' (SentencePiece BPE)")
        tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
        backend = (_gguf_bpe if kind == "gpt2" else _gguf_spm)(reader, tokens)
        _add_tokens(backend, tokens, gguf_field(reader, "tokenizer.ggml.token_type", []))
        bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
        eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
        add_bos = bos is not None and gguf_field(reader, "tokenizer.ggml.add_bos_token", False)
        add_eos = eos is not None and gguf_field(reader, "tokenizer.ggml.add_eos_token", False)
        backend.post_processor = _edge_processor(
            (tokens[bos], bos) if add_bos else None, (tokens[eos], eos) if add_eos else None
        )
        return cls(backend, bos_token_id=bos, eos_token_id=eos,
                   chat_template=gguf_field(reader, "tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load ``tokenizer.json`` plus ``tokenizer_config.json`` (bos/eos, chat template).

        The chat template comes from ``chat_template.jinja`` when present (recent transformers
        versions write it there), else from ``tokenizer_config.json``'s ``chat_template``.

        Raises:
            FileNotFoundError: ``tokenizer.json`` is missing.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path / 'tokenizer.json'} not found")
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # NOTE: named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()

        def token_id(key: str) -> int | None:
            token = config.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            return backend.token_to_id(token) if token else None

        return cls(backend, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                   chat_template=template)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special (control) token, which ``decode`` skips."""
        return token_id in self._special_ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) map to
        their single id. BOS/EOS are added only where the tokenizer's source asks for it.

        NOTE: ``encode_batch`` releases the GIL (``encode`` holds it: ~5 s for a 4 MB text), so
        a thread tokenizing a long prompt leaves the caller's event loop running."""
        return self.backend.encode_batch([text], add_special_tokens=True)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 byte sequences decode to U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render ``messages`` with the tokenizer's jinja2 chat template, as transformers does.

        Each message needs a non-empty str ``role`` and a str ``content``; other keys are passed
        through to the template. ``bos_token``/``eos_token`` are available as strings; ``tools``
        (OpenAI's tool objects, ``{"type": "function", "function": {...}}``) as ``tools``, as
        transformers passes them (None: the template sees no tools).

        Raises:
            ValueError: no chat template, a malformed message (the message names the field, e.g.
                ``messages[1].content``), or the template's ``raise_exception`` rejected them.
        """
        if not self.chat_template:
            raise ValueError("tokenizer has no chat_template")
        _check_messages(messages)
        import jinja2

        template = _compile_template(self.chat_template)
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                bos_token=self._token_or_empty(self._bos_token_id),
                eos_token=self._token_or_empty(self._eos_token_id),
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc

    def _token_or_empty(self, token_id: int | None) -> str:
        return (self.backend.id_to_token(token_id) or "") if token_id is not None else ""


def _gguf_bpe(reader: Any, tokens: list[str]) -> tokenizers.Tokenizer:
    """Byte-level BPE from ``tokenizer.ggml.*`` (``model`` ``gpt2``)."""
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges", [])]
    pre, ignore_merges = _pre_tokenizer(gguf_field(reader, "tokenizer.ggml.pre", "default"))
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_spm(reader: Any, tokens: list[str]) -> tokenizers.Tokenizer:
    """SentencePiece BPE from ``tokenizer.ggml.*`` (``model`` ``llama``), as llama.cpp's SPM
    tokenizer (``llm_tokenizer_spm``) reads it: of the adjacent pairs whose concatenation is a
    piece, the one making the highest-scoring piece (``tokenizer.ggml.scores``) merges first;
    a character outside the vocabulary falls back to its UTF-8 bytes (``<0xXX>`` pieces); a
    space is ``▁``, and one is prepended to each run of text (after each special token, as
    llama.cpp does) unless ``tokenizer.ggml.add_space_prefix`` is false (Gemma).

    The score order becomes BPE merge ranks (``_merges_by_score``, the conversion
    transformers' ``SentencePieceExtractor`` makes), so the Rust BPE runs it."""
    scores: list[float] = gguf_field(reader, "tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError("tokenizer.ggml.scores: a SentencePiece ('llama') tokenizer needs one "
                         f"score per token ({len(tokens)})")
    unk = gguf_field(reader, "tokenizer.ggml.unknown_token_id")
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(
        vocab, _merges_by_score(tokens, scores), unk_token=None if unk is None else tokens[unk],
        fuse_unk=True, byte_fallback=True))
    prefix = bool(gguf_field(reader, "tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend(_SPACE)] * prefix + [normalizers.Replace(" ", _SPACE)])
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + [decoders.Strip(" ", 1, 0)] * prefix)
    return backend


def _merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces, the splits of higher-scoring pieces first
    (those of one piece by their halves' ids): SentencePiece's merge order as BPE ranks."""
    ids = {token: i for i, token in enumerate(tokens)}
    merges = [(-score, ids[piece[:k]], ids[piece[k:]], piece[:k], piece[k:])
              for piece, score in zip(tokens, scores)
              for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
    merges.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in merges]


def _add_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens."""
    # NOTE: added tokens are matched whole before normalization and pre-tokenization, so
    # "<|im_start|>" in text is one id; tokens already in the vocabulary keep their ids.
    backend.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                                for i, t in enumerate(types) if t == _CONTROL])
    backend.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                        for i, t in enumerate(types) if t == _USER_DEFINED])


def _edge_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.PostProcessor | None:
    """Post-processor adding ``bos`` before and/or ``eos`` after the ids, or None for neither."""
    if bos is None and eos is None:
        return None
    edges = [e for e in (bos, eos) if e is not None]
    single = " ".join(([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else []))
    pair = " ".join([single] + ([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else []))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=edges)


def _check_messages(messages: Any) -> None:
    """Raise ValueError naming the first field of ``messages`` that is malformed."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces for streaming responses.

    ``step`` returns only the new text, or ``""`` while a UTF-8 character is split across
    tokens, so a partial character never shows as U+FFFD. Backed by ``tokenizers``'
    ``DecodeStream`` (the prefix/read-offset method of vLLM's ``detokenize_incrementally``):
    the concatenation of all ``step`` results equals ``tokenizer.decode(all_ids)`` except for
    trailing bytes that never form a character (dropped, where ``decode`` shows U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Append ``token_id``; return the text it completes (possibly ``""``)."""
        return self._stream.step(self._backend, token_id) or ""
