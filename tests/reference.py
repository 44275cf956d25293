"""The correctness oracle: transformers' LlamaForCausalLM on the same GGUF weights, greedy, fp32.

Outputs are computed once per test session and shared by the offline and stack tests.
"""
from __future__ import annotations

import functools

import torch

from loadtest.chat_prompts import ORACLE_PROMPTS
from services.engine.model_files import default_model_path
from services.engine.tokenizer import Tokenizer

CHAT_PROMPTS = ORACLE_PROMPTS
NUM_TOKENS = 40  # >= 32 compared per prompt; ignore_eos so every prompt gives all of them


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.load(default_model_path())


def chat_prompt_ids(prompt: str) -> list[int]:
    tok = tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))


@functools.cache
def hf_greedy_outputs() -> tuple[tuple[int, ...], ...]:
    """Greedy continuation of each CHAT_PROMPTS entry, NUM_TOKENS tokens, from transformers."""
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
