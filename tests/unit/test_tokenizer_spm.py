"""SentencePiece tokenizers in GGUF files (``tokenizer.ggml.model`` ``llama``: Llama 2, Mistral,
Gemma, Phi-3) against the sentencepiece library itself.

A small BPE model is trained inside the test on the repository's public-domain text
(byte fallback on, identity normalization as Llama's and Gemma's models have) and written into
a GGUF the way llama.cpp's converter writes one (pieces, scores, token types, special ids,
``add_space_prefix``); the tokenizer rebuilt from that file must give sentencepiece's ids for
every text and decode them back to it, streaming included."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.tokenizer import IncrementalDetokenizer, Tokenizer

spm = pytest.importorskip("sentencepiece")

TEXT = Path(__file__).resolve().parents[2] / "loadtest" / "texts" / "public_domain.txt"
TEXTS = [
    "Hello world", "  two leading spaces", "trailing  ", "a  b   c", "line one\nline two\n\n",
    "tabs\tand\tmore", "12345 + 678 = 7023", "café naïve façade", "日本語のテキスト", "emoji 🦙🚀!",
    "", " ", "It was the best of times, it was the worst of times.",
]
# llama.cpp's llama_token_type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _train(tmp: Path, dummy_prefix: bool):
    prefix = tmp / ("spm" if dummy_prefix else "spm-noprefix")
    spm.SentencePieceTrainer.train(
        input=str(TEXT), model_prefix=str(prefix), model_type="bpe", vocab_size=600,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=dummy_prefix, split_digits=True, user_defined_symbols=["<|im_start|>"],
        character_coverage=1.0, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


def _write_gguf(sp, path: Path, dummy_prefix: bool) -> Path:
    """What ``convert_hf_to_gguf.py``'s ``_set_vocab_sentencepiece`` writes."""
    import gguf

    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else
             BYTE if sp.is_byte(i) else UNUSED if sp.is_unused(i) else
             USER_DEFINED if p == "<|im_start|>" else NORMAL for i, p in enumerate(pieces)]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([sp.get_score(i) for i in range(len(pieces))])
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_space_prefix(dummy_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-prefix (Gemma)"])
def pair(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spm")
    sp = _train(tmp, request.param)
    return sp, Tokenizer.from_gguf(_write_gguf(sp, tmp / "spm.gguf", request.param))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_are_sentencepieces_with_bos(pair, text):
    sp, tok = pair
    assert tok.encode(text) == [sp.bos_id(), *sp.encode(text)]


def test_the_whole_text_tokenizes_as_sentencepiece_does(pair):
    sp, tok = pair
    text = TEXT.read_text()
    assert tok.encode(text)[1:] == sp.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_and_streaming_give_the_text_back(pair, text):
    sp, tok = pair
    ids = tok.encode(text)
    assert tok.decode(ids) == sp.decode(ids[1:]) == text
    stream = IncrementalDetokenizer(tok)
    assert "".join(stream.step(i) for i in ids) == text


def test_special_and_user_defined_pieces(pair):
    sp, tok = pair
    im_start = sp.piece_to_id("<|im_start|>")
    assert tok.encode("<|im_start|>")[1:] == [im_start]
    assert tok.is_special(sp.eos_id()) and not tok.is_special(im_start)
    assert (tok.bos_token_id, tok.eos_token_id) == (sp.bos_id(), sp.eos_id())
    assert tok.decode([sp.bos_id(), *sp.encode("hi")]) == "hi"  # BOS skipped
