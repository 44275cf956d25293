"""Tokenizer against transformers' GGUF tokenizer, llama.cpp's digit split, and tiny GGUF vocabularies."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n\n\tindented()\n",
    "I ❤️ 🤖 emoji 👨‍👩‍👧 and flags 🇫🇷",
    "你好，世界。日本語のテキストと한국어",
    "12345 and 3.14 and 1,000,000 and 2024-01-31",
    "x 1, x 12, (1+2)*3",
    "don't I'll we've THEY'RE",
    "  leading spaces and trailing   ",
    "naïve café — “quotes” ‘single’ …",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 🤖 and 数字 42."},
    ],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
]


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.load(gguf_path)


@pytest.fixture(scope="module")
def hf_tok(gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)


def test_known_ids(tok: Tokenizer) -> None:
    assert tok.encode("12345") == [33, 34, 35, 36, 37]  # '1'..'5': one token per digit
    assert tok.encode("3.14") == [35, 30, 33, 36]
    assert tok.encode("<|im_start|>user\nHi<|im_end|>\n") == [1, 4093, 198, 26843, 2, 198]


def test_digits_split_like_llama_cpp_not_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    """``'x  1'``: llama.cpp's ``smollm`` pre-tokenizer (and SmolLM2's own tokenizer.json) split
    every digit off first, leaving ``'x  '`` -> GPT-2 regex -> ``'x'``, ``'  '`` (``\\s+(?!\\S)``
    takes both spaces at the end of the piece) -> ids [104 'x', 256 'ĠĠ', 33 '1'].
    transformers' GGUF tokenizer skips the digit split, so the regex sees ``'x'``, ``' '``,
    ``' 1'`` -> [104 'x', 216 'Ġ', 216 'Ġ', 33 '1'] (there is no 'Ġ1' merge)."""
    assert [tok.backend.id_to_token(i) for i in (104, 256, 33, 216)] == ["x", "ĠĠ", "1", "Ġ"]
    assert tok.encode("x  1") == [104, 256, 33]
    assert hf_tok.encode("x  1", add_special_tokens=False) == [104, 216, 216, 33]
    assert tok.decode([104, 256, 33]) == "x  1"


def test_special_ids_and_sizes(tok: Tokenizer) -> None:
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 49152)
    assert [i for i in range(20) if tok.is_special(i)] == list(range(17))
    assert not tok.is_special(49151)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip_skips_special_tokens(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    expected = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert tok.decode(ids) == expected


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, messages: list, add_generation_prompt: bool
) -> None:
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


def test_chat_template_exact_text(tok: Tokenizer) -> None:
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("messages, field", [
    ([{"content": "hi"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "a"}, {"role": "", "content": "b"}], r"messages\[1\]\.role"),
    ([{"role": "user"}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": ["parts"]}], r"messages\[0\]\.content"),
    (["hello"], r"messages\[0\]"),
    ([], "messages"),
])
def test_chat_template_rejects_bad_messages(tok: Tokenizer, messages: list, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        tok.apply_chat_template(messages)


def test_incremental_detokenizer_known_pieces(tok: Tokenizer) -> None:
    def pieces(text: str) -> list[str]:
        detok = IncrementalDetokenizer(tok)
        return [detok.step(i) for i in tok.encode(text)]

    assert pieces("你好") == ["", "你", "", "好"]  # each CJK character is two byte-level tokens
    assert pieces("🤖!") == ["", "", "🤖", "!"]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_equals_full_decode(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [detok.step(i) for i in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def test_hf_dir_tokenizer_matches_transformers(tmp_path: Path, hf_tok: Any) -> None:
    """``save_pretrained`` writes transformers' tokenizer.json (no digit split) plus its config."""
    hf_tok.save_pretrained(tmp_path)
    ours = Tokenizer.load(tmp_path)
    for text in TEXTS + ["x  1"]:
        assert ours.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
    assert (ours.bos_token_id, ours.eos_token_id, ours.vocab_size) == (1, 2, 49152)
    assert ours.is_special(2) and not ours.is_special(17)
    expected = [hf_tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                for m in CONVERSATIONS]
    assert [ours.apply_chat_template(m) for m in CONVERSATIONS] == expected
    # Older transformers kept the template in tokenizer_config.json instead of chat_template.jinja.
    template = (tmp_path / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert [Tokenizer.from_hf_dir(tmp_path).apply_chat_template(m) for m in CONVERSATIONS] == expected


# --- tiny synthetic GGUF vocabularies ------------------------------------------------------

_TINY_TOKENS = ["<s>", "</s>", "1", "2", "12", "a", "Ġ", "Ġa", "<tool>"]
_TINY_TYPES = [3, 3, 1, 1, 1, 1, 1, 1, 4]  # control, control, normal..., user-defined


def _write_tokenizer_gguf(
    path: Path, model: str = "gpt2", pre: str = "smollm", add_bos: bool = False
) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("tokenizer.ggml.model", model)
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", _TINY_TOKENS)
    writer.add_array("tokenizer.ggml.token_type", _TINY_TYPES)
    writer.add_array("tokenizer.ggml.merges", ["1 2", "Ġ a"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 0)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 1)
    writer.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre, ids", [("smollm", [2, 3, 7]), ("gpt2", [4, 7]), ("default", [4, 7]),
                                     ("qwen2", [2, 3, 7]), ("llama-bpe", [4, 7])])
def test_pre_tokenizer_is_honoured(tmp_path: Path, pre: str, ids: list[int]) -> None:
    tok = Tokenizer.from_gguf(_write_tokenizer_gguf(tmp_path / "t.gguf", pre=pre))
    assert tok.encode("12 a") == ids  # smollm splits "1" and "2" apart, so the "1 2" merge never applies


def test_qwen2_pre_tokenizer_splits_as_qwen2s_tokenizer_json(tmp_path: Path) -> None:
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    ours = Tokenizer.from_gguf(_write_tokenizer_gguf(tmp_path / "t.gguf", pre="qwen2"))
    theirs = Qwen2Tokenizer(vocab={"a": 0}, merges=[]).backend_tokenizer.pre_tokenizer
    text = "It's 2025: 12345 tokens,\n\n  don't   stop!"
    assert (ours.backend.pre_tokenizer.pre_tokenize_str(text)
            == theirs.pre_tokenize_str(text))


def test_add_bos_token_and_added_tokens(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(_write_tokenizer_gguf(tmp_path / "t.gguf", add_bos=True))
    assert tok.encode("a<tool></s>") == [0, 5, 8, 1]
    assert tok.decode([0, 5, 8, 1]) == "a<tool>"  # user-defined <tool> is kept, control tokens skipped
    assert (tok.is_special(0), tok.is_special(8)) == (True, False)
    assert Tokenizer.from_gguf(_write_tokenizer_gguf(tmp_path / "n.gguf")).encode("a") == [5]


@pytest.mark.parametrize("kwargs, match", [({"pre": "bogus"}, "'bogus'"), ({"model": "rwkv"}, "'rwkv'"),
                                           ({"model": "llama"}, "tokenizer.ggml.scores")])
def test_unsupported_tokenizer_names_the_value(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_gguf(_write_tokenizer_gguf(tmp_path / "t.gguf", **kwargs))


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)
