"""Structured outputs: a request's output held to a JSON schema, a regular expression, a choice
of strings or a grammar, by masking at every step each token that cannot continue a valid
output (vLLM's structured outputs, OpenAI's ``response_format``).

Grammars, their compilation and the token masks come from llguidance (the Rust library behind
llama.cpp's and vLLM's ``guidance`` backend): JSON schema (``format="json"``), Rust regex
(``regex``), a JSON list of strings (``choice``), and Lark or llama.cpp's GBNF (``grammar``).
Chosen over xgrammar on what it costs the runtime: llguidance's wheel needs no other package,
where xgrammar requires transformers, triton and apache-tvm-ffi; both compute a mask in tens of
microseconds (llguidance: 7 us for one row's mask under a small JSON schema over the built-in model's
49,152 tokens, AMD EPYC 2 cores, `python -m scripts.bench_structured`).

``grammar_of`` compiles (and validates: ``ValueError`` naming ``structured_output``) once per
spec, cached. ``Matchers`` keeps one matcher per constrained request: it follows the request's
output tokens (``advance``), fills the request's row of a step's token bitmask (one bit per
token id, 1 = allowed, 32 ids per ``int32`` word, llguidance's layout) and reports a matcher
that left the grammar. This module imports no torch; llguidance is imported on first use.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.errors import InvalidArgument

if TYPE_CHECKING:
    import numpy as np


@functools.lru_cache(maxsize=256)
def grammar_of(format: str, spec: str) -> str:
    """llguidance's grammar for a structured output's ``format`` (json, regex, choice,
    grammar) and ``spec``, validated. Raises ``InvalidArgument`` naming ``structured_output`` when
    the spec does not compile (the message says why)."""
    import llguidance

    fmt = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}[format]
    if format == "choice":
        try:
            choices = json.loads(spec)
        except ValueError as exc:
            raise InvalidArgument("structured_output",
                                  f"choice must be a JSON list of strings: {exc}") from None
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise InvalidArgument("structured_output", "choice must be a non-empty list of strings")
    try:
        grammar = llguidance.grammar_from(fmt, spec)
    except ValueError as exc:
        raise InvalidArgument("structured_output", f"{format}: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidArgument("structured_output", f"{format}: {error.strip()}")
    return grammar


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask."""
    return (vocab_size + 31) // 32


class Matchers:
    """One grammar matcher per constrained request, over the model's vocabulary.

    ``tokenizer_json``: returns the model's tokenizer as ``tokenizers`` JSON (called once, on
    first use: building llguidance's tokenizer takes ~0.5 s); ``vocab_size``: the model's
    (ids beyond the tokenizer's are never allowed); ``eos_token_id``: where a finished output
    must end.
    """

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_token_id: int | None) -> None:
        self._tokenizer_json, self.vocab_size, self.eos_token_id = tokenizer_json, vocab_size, eos_token_id
        self.words = bitmask_words(vocab_size)
        self._matchers: dict[str, list] = {}  # request id -> [matcher, output tokens consumed]

    @functools.cached_property
    def _tokenizer(self):
        import llguidance

        return llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                      eos_token=self.eos_token_id)

    def add(self, request_id: str, format: str, spec: str) -> None:
        """Start a matcher for ``request_id`` at the beginning of its output (``format`` and
        ``spec`` as ``grammar_of``'s)."""
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, grammar_of(format, spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_output: {matcher.get_error()}")
        self._matchers[request_id] = [matcher, 0]

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def advance(self, request_id: str, output: np.ndarray) -> None:
        """Feed the matcher the output tokens it has not seen (``output``: every output token so
        far, earlier attempts' included). Raises ``ValueError`` when a token leaves the grammar
        (the request's own fault: it fails alone)."""
        entry = self._matchers[request_id]
        matcher, seen = entry
        for token in output[seen:].tolist():
            if not matcher.consume_token(token):
                raise ValueError(f"structured_output: token {token} does not continue the "
                                 f"grammar ({matcher.get_error()})")
        entry[1] = len(output)

    def fill(self, request_id: str, bitmask: np.ndarray) -> None:
        """Write the request's allowed next tokens into ``bitmask`` (one row, ``[words]``
        int32, C-contiguous)."""
        matcher = self._matchers[request_id][0]
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        if matcher.is_error():
            raise ValueError(f"structured_output: {matcher.get_error()}")
