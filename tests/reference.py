"""The correctness oracle: transformers' LlamaForCausalLM on the same GGUF weights, greedy, fp32.

Its outputs for ``CHAT_PROMPTS`` are stored in ``tests/data/hf_greedy.json`` so that every test
compares against transformers unconditionally, whatever runs before it (computing them costs
minutes on a loaded 2-core machine). Regenerate the file after changing the prompts, the model
or ``NUM_TOKENS``::

    python -m tests.reference

``test_stack.py::test_stored_reference_is_what_transformers_computes`` recomputes them with
transformers in every full run, so the file cannot drift from the oracle unnoticed.
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

from loadtest.chat_prompts import ORACLE_PROMPTS
from services.engine.model_files import default_model_path
from services.engine.tokenizer import Tokenizer

CHAT_PROMPTS = ORACLE_PROMPTS
NUM_TOKENS = 40  # >= 32 compared per prompt; ignore_eos so every prompt gives all of them
REFERENCE_FILE = Path(__file__).parent / "data" / "hf_greedy.json"


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.load(default_model_path())


def chat_prompt_ids(prompt: str) -> list[int]:
    tok = tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))


def _model_key() -> dict:
    path = default_model_path()
    return {"model_file": path.name, "model_bytes": path.stat().st_size, "num_tokens": NUM_TOKENS}


@functools.cache
def hf_greedy_outputs() -> tuple[tuple[int, ...], ...]:
    """Transformers' greedy continuation (NUM_TOKENS token ids) of each CHAT_PROMPTS entry, read
    from ``REFERENCE_FILE``. Raises AssertionError when the file was made for another model,
    length, prompt list or tokenization (regenerate it: ``python -m tests.reference``)."""
    stored = json.loads(REFERENCE_FILE.read_text())
    stale = "stale; regenerate it with `python -m tests.reference`"
    assert stored["key"] == _model_key(), f"{REFERENCE_FILE}: {stored['key']} {stale}"
    assert [e["prompt"] for e in stored["outputs"]] == list(CHAT_PROMPTS), f"{REFERENCE_FILE}: prompts {stale}"
    for entry in stored["outputs"]:
        assert entry["prompt_token_ids"] == chat_prompt_ids(entry["prompt"]), f"{REFERENCE_FILE}: ids {stale}"
        assert len(entry["output_token_ids"]) == NUM_TOKENS
    return tuple(tuple(e["output_token_ids"]) for e in stored["outputs"])


def compute_hf_greedy_outputs() -> tuple[tuple[int, ...], ...]:
    """The same outputs computed now by transformers (about a minute on an idle CPU)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in CHAT_PROMPTS:
            ids = chat_prompt_ids(prompt)
            # NOTE: an explicit attention mask: without one transformers infers it from
            # pad_token_id (= <|im_end|> here) and masks every <|im_end|> of the chat prompt
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NUM_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=tokenizer().eos_token_id)
            outputs.append(tuple(out[0, len(ids):].tolist()))
    return tuple(outputs)


def _dumps(doc: dict) -> str:
    """The file's JSON: one line for the key and one per prompt (diffs stay readable)."""
    lines = ",\n  ".join(json.dumps(e) for e in doc["outputs"])
    return f'{{"key": {json.dumps(doc["key"])},\n "outputs": [\n  {lines}\n ]}}\n'


def main() -> int:
    """Recompute the reference with transformers and write ``REFERENCE_FILE``."""
    outputs = compute_hf_greedy_outputs()
    doc = {"key": _model_key(),
           "outputs": [{"prompt": p, "prompt_token_ids": chat_prompt_ids(p), "output_token_ids": list(o)}
                       for p, o in zip(CHAT_PROMPTS, outputs)]}
    REFERENCE_FILE.parent.mkdir(exist_ok=True)
    REFERENCE_FILE.write_text(_dumps(doc))
    print(f"wrote {REFERENCE_FILE}: {len(outputs)} prompts x {NUM_TOKENS} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
