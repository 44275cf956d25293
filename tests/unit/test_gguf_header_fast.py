"""The gateway reads the model's card and tokenizer with ``gguf_file.GGUFFile`` (one pass with
``struct``) instead of ``gguf.GGUFReader`` (a numpy view per vocabulary string: seconds of
every gateway start); what it reads must be the same."""
from __future__ import annotations

import pytest
from gguf import GGUFReader

from services.engine.gguf_file import GGUFFile
from services.engine.gguf_metadata import gguf_field
from services.engine.model_files import default_model_path
from services.engine.tokenizer import GGUF_STRING_ARRAYS, Tokenizer
from services.gateway.model_card import ModelCard, load_model_header

TEXTS = ["What is the capital of France?", "x  1 and 22  333 digits", "héllo wörld ✓ 日本",
         "<|im_start|>user\nhi<|im_end|>", "  leading spaces\n\n\ttabs", ""]


@pytest.fixture(scope="module")
def readers():
    path = default_model_path()
    return GGUFReader(path), GGUFFile(path, GGUF_STRING_ARRAYS)


@pytest.mark.parametrize("key", ["general.architecture", "llama.context_length",
                                 "tokenizer.ggml.model", "tokenizer.ggml.pre",
                                 "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                 "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
                                 "tokenizer.ggml.token_type", *GGUF_STRING_ARRAYS, "no.such.key"])
def test_fields_equal_gguf_readers(readers, key):
    slow, fast = readers
    want = gguf_field(slow, key, "absent")
    got = gguf_field(fast, key, "absent")
    assert got == want and type(got) is type(want)


def test_tokenizer_and_card_equal_gguf_readers(readers):
    slow, fast = readers
    want, got = Tokenizer.from_gguf_reader(slow), Tokenizer.from_gguf_reader(fast)
    for text in TEXTS:
        assert got.encode(text) == want.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert got.apply_chat_template(messages) == want.apply_chat_template(messages)
    assert (got.bos_token_id, got.eos_token_id) == (want.bos_token_id, want.eos_token_id)
    card, tokenizer = load_model_header(default_model_path())
    assert card == ModelCard.from_gguf_reader(slow, card.name)
    assert tokenizer.encode(TEXTS[0]) == want.encode(TEXTS[0])
    assert ModelCard.load(default_model_path()) == card


def test_header_of_a_file_with_tensor_types_the_engine_cannot_run(tmp_path):
    """The card and tokenizer need only metadata: an i-quant tensor (which the engine cannot
    read) does not stop them."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "i-quant.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab", "<|im_start|>"])
    w.add_token_merges(["a b"])
    w.add_token_types([1, 1, 1, 3])
    w.add_bos_token_id(3)
    w.add_eos_token_id(3)
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((1, 18), dtype=np.uint8),
                 raw_dtype=GGMLQuantizationType.IQ4_NL)  # one 32-weight block
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="ggml type"):
        GGUFFile(path)  # the engine's reader refuses it, naming the type
    card, tokenizer = load_model_header(path)
    assert (card.max_model_len, card.vocab_size) == (64, 4)
    assert tokenizer.encode("ab<|im_start|>") == [2, 3]
    assert Tokenizer.load(path).encode("ab") == [2]
