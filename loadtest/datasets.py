"""Datasets for ``bench serve``: seeded lists of ``SampleRequest`` (a prompt and an output length).

- ``random``: prompts of random token ids (decoded to text, re-encoded to the exact length) and
  output lengths drawn uniformly from ``len * [1 - range_ratio, 1 + range_ratio]``, both sent with
  ``ignore_eos`` so the output length is exact (vLLM's ``--dataset-name random``).
- ``sharegpt``: a ShareGPT-format JSON file (a list of ``{"conversations": [{"from", "value"},
  ...]}``); the first human turn is the prompt, the first reply's length the output length.
- ``prefix``: ``num_prefixes`` long shared documents (or system prompts) of ``prefix_len``
  tokens x questions: each request is one document followed by a question of its own
  (``input_len`` random tokens), the documents dealt in shuffled order (every document
  ``ceil(n / num_prefixes)`` times; vLLM's ``prefix_repetition``): what a prefix cache and
  prefix-aware routing are for.
- ``multiturn``: conversations whose every turn resends the whole history (user turns of
  ``input_len`` tokens, assistant replies of ``output_len``, ``num_turns`` turns each, as chat
  messages); turn t of every conversation comes before turn t + 1 of any, the conversations in
  shuffled order within a turn. The replies in the history are the dataset's own (fixed text,
  not what the model said), so a turn's prompt extends the previous turn's prompt: a worker
  that served the previous turn holds its prefix.
- ``chat``: the built-in instruct prompts (``loadtest.chat_prompts``) as one user turn each,
  run to EOS or ``chat_max_tokens``.
- ``long-mix``: ``chat`` plus, with probability ``long_fraction``, a long random prompt of
  ``long_input_range`` tokens (1.5k-4k by default): the interference study of disaggregation
  (DistServe section 2: a long prefill stalls colocated decode steps).

Every request carries ``kind`` (``random``, ``sharegpt``, ``prefix``, ``multiturn``, ``chat``,
``long``) so the
report can split figures per kind. A tokenizer is anything with ``encode(text) -> list[int]``,
``decode(ids) -> str``, ``apply_chat_template(messages) -> str`` and ``vocab_size``.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from loadtest.chat_prompts import CHAT_PROMPTS

FIRST_NORMAL_TOKEN = 17  # ids 0-16 are control tokens in SmolLM2's vocabulary
DATASETS = ("random", "sharegpt", "prefix", "multiturn", "chat", "long-mix")


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    """One request of a run.

    ``prompt`` is raw text (sent as is to a completions endpoint or as the gRPC ``prompt``);
    ``messages``, when set, is a chat conversation a chat endpoint renders with its template
    (then ``prompt`` is that rendering, for completions endpoints). ``prompt_len`` is in tokens
    as the client's tokenizer counts them; ``output_len`` is exact when ``ignore_eos``, else a cap.
    """

    prompt: str
    prompt_len: int
    output_len: int
    ignore_eos: bool
    kind: str
    messages: tuple[dict[str, str], ...] | None = field(default=None)


@dataclass(frozen=True)
class DatasetOptions:
    """Knobs of every dataset (lengths in tokens)."""

    seed: int = 0
    input_len: int = 128             # random/prefix: prompt (suffix) length
    output_len: int = 64             # random/prefix: output length
    range_ratio: float = 0.0         # random: lengths uniform in len * [1 - r, 1 + r]
    prefix_len: int = 256            # prefix: shared document / system prompt length
    num_prefixes: int = 4            # prefix: distinct shared documents
    num_turns: int = 4               # multiturn: turns per conversation
    sharegpt_path: str = ""          # sharegpt: the JSON file
    sharegpt_output_len: int = 0     # sharegpt: > 0 overrides each reply's length
    chat_max_tokens: int = 128       # chat / long-mix: output cap (EOS ends earlier)
    long_fraction: float = 0.2       # long-mix: probability that a request is long
    long_input_range: tuple[int, int] = (1536, 4096)
    long_output_len: int = 16        # long-mix: exact output length of a long prompt

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "prefix_len", "num_prefixes", "num_turns",
                     "chat_max_tokens", "long_output_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")
        lo, hi = self.long_input_range
        if not 0 < lo <= hi:
            raise ValueError(f"long_input_range must be 0 < lo <= hi, got {self.long_input_range}")


def random_text(rng: random.Random, tokenizer: TokenizerLike, num_tokens: int) -> tuple[str, int]:
    """Text of about ``num_tokens`` random tokens: ids are decoded, re-encoded and cut to
    ``num_tokens`` (decoding can merge tokens), then decoded once more. Returns (text, its
    token count under ``tokenizer``)."""
    ids = [rng.randrange(FIRST_NORMAL_TOKEN, tokenizer.vocab_size) for _ in range(num_tokens)]
    ids = tokenizer.encode(tokenizer.decode(ids))[:num_tokens]
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text))


def _uniform_len(rng: random.Random, length: int, ratio: float) -> int:
    return max(1, rng.randint(int(length * (1 - ratio)), int(length * (1 + ratio))))


def random_dataset(n: int, tokenizer: TokenizerLike, opts: DatasetOptions) -> list[SampleRequest]:
    rng = random.Random(opts.seed)
    out = []
    for _ in range(n):
        text, plen = random_text(rng, tokenizer, _uniform_len(rng, opts.input_len, opts.range_ratio))
        out.append(SampleRequest(text, plen, _uniform_len(rng, opts.output_len, opts.range_ratio),
                                 True, "random"))
    return out


def prefix_dataset(n: int, tokenizer: TokenizerLike, opts: DatasetOptions) -> list[SampleRequest]:
    rng = random.Random(opts.seed)
    prefixes = [random_text(rng, tokenizer, opts.prefix_len)[0] for _ in range(opts.num_prefixes)]
    per_prefix = -(-n // opts.num_prefixes)
    order = [d for d in range(opts.num_prefixes) for _ in range(per_prefix)]
    rng.shuffle(order)
    out = []
    for d in order[:n]:
        suffix, _ = random_text(rng, tokenizer, opts.input_len)
        text = prefixes[d] + "\n" + suffix  # a break: no merge across
        out.append(SampleRequest(text, len(tokenizer.encode(text)), opts.output_len, True, "prefix"))
    return out


def multiturn_dataset(n: int, tokenizer: TokenizerLike, opts: DatasetOptions) -> list[SampleRequest]:
    rng = random.Random(opts.seed)
    conversations = [[] for _ in range(-(-n // opts.num_turns))]  # messages so far, each
    out = []
    for _turn in range(opts.num_turns):
        order = list(range(len(conversations)))
        rng.shuffle(order)
        for c in order:
            if len(out) == n:
                return out
            history = conversations[c]
            history.append({"role": "user", "content": random_text(rng, tokenizer, opts.input_len)[0]})
            messages = tuple(dict(m) for m in history)
            text = tokenizer.apply_chat_template(list(messages))
            out.append(SampleRequest(text, len(tokenizer.encode(text)), opts.output_len, True,
                                     "multiturn", messages))
            history.append({"role": "assistant",
                            "content": random_text(rng, tokenizer, opts.output_len)[0]})
    return out


def _chat_request(tokenizer: TokenizerLike, content: str, max_tokens: int) -> SampleRequest:
    messages = ({"role": "user", "content": content},)
    text = tokenizer.apply_chat_template(list(messages))
    return SampleRequest(text, len(tokenizer.encode(text)), max_tokens, False, "chat", messages)


def chat_dataset(n: int, tokenizer: TokenizerLike, opts: DatasetOptions) -> list[SampleRequest]:
    order = list(CHAT_PROMPTS)
    random.Random(opts.seed).shuffle(order)
    return [_chat_request(tokenizer, order[i % len(order)], opts.chat_max_tokens) for i in range(n)]


def long_mix_dataset(n: int, tokenizer: TokenizerLike, opts: DatasetOptions) -> list[SampleRequest]:
    rng = random.Random(opts.seed + 1)
    out = chat_dataset(n, tokenizer, opts)
    for i in range(n):
        if rng.random() < opts.long_fraction:
            text, plen = random_text(rng, tokenizer, rng.randint(*opts.long_input_range))
            out[i] = SampleRequest(text, plen, opts.long_output_len, True, "long")
    return out


def _sharegpt_turns(index: int, entry: Any) -> list[tuple[str, str]]:
    """(from, value) of an entry's turns; ValueError naming the entry when malformed."""
    name = f"entry {index}" + (f" (id {entry.get('id')!r})" if isinstance(entry, dict) and "id" in entry else "")
    if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
        raise ValueError(f"sharegpt {name}: expected an object with a 'conversations' list")
    turns = []
    for j, turn in enumerate(entry["conversations"]):
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str)
                and isinstance(turn.get("value"), str)):
            raise ValueError(f"sharegpt {name}: conversations[{j}] must be an object with "
                             f"string 'from' and 'value'")
        turns.append((turn["from"], turn["value"]))
    return turns


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, reply) pairs of a ShareGPT-format JSON file: the first two turns of each entry
    with at least two (shorter entries are skipped, as vLLM does).

    Raises:
        ValueError: the file is not JSON, not a list, or an entry is malformed (the message
            names the entry's index and id).
        FileNotFoundError: no such file.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"sharegpt file {path}: not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"sharegpt file {path}: expected a JSON list of entries")
    pairs = []
    for i, entry in enumerate(data):
        turns = _sharegpt_turns(i, entry)
        if len(turns) >= 2:
            pairs.append((turns[0][1], turns[1][1]))
    if not pairs:
        raise ValueError(f"sharegpt file {path}: no entry has two turns")
    return pairs


def sharegpt_dataset(n: int, tokenizer: TokenizerLike, opts: DatasetOptions) -> list[SampleRequest]:
    if not opts.sharegpt_path:
        raise ValueError("sharegpt_path must name a ShareGPT JSON file for --dataset sharegpt")
    pairs = load_sharegpt(opts.sharegpt_path)
    random.Random(opts.seed).shuffle(pairs)
    out = []
    for i in range(n):
        prompt, reply = pairs[i % len(pairs)]
        output_len = opts.sharegpt_output_len or max(1, len(tokenizer.encode(reply)))
        req = _chat_request(tokenizer, prompt, output_len)
        out.append(SampleRequest(req.prompt, req.prompt_len, output_len, True, "sharegpt",
                                 req.messages))
    return out


def build_dataset(name: str, n: int, tokenizer: TokenizerLike,
                  opts: DatasetOptions) -> list[SampleRequest]:
    """``n`` requests of dataset ``name`` (one of ``DATASETS``); same arguments, same list.

    Raises:
        ValueError: unknown ``name``, ``n`` <= 0, or a dataset's own error (see the loaders).
    """
    if n <= 0:
        raise ValueError(f"num_prompts must be > 0, got {n}")
    builders = {"random": random_dataset, "sharegpt": sharegpt_dataset, "prefix": prefix_dataset,
                "multiturn": multiturn_dataset, "chat": chat_dataset, "long-mix": long_mix_dataset}
    if name not in builders:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {name!r}")
    return builders[name](n, tokenizer, opts)
