"""Turns a request's output tokens into text: incremental detokenization plus stop strings.

Stop strings follow OpenAI's semantics (and vLLM's): generation ends at the first occurrence,
which may span token boundaries, and neither it nor anything after it is returned. Text that
could still become a stop string is held back until it is resolved. As in vLLM, stop strings
are not checked before ``min_tokens`` output tokens.
"""
from __future__ import annotations

from .sampling_params import SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer


class StopStringMatcher:
    """Streamed text in, safe text out: ``step(delta) -> (text to emit, stopped)``."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._pending = ""  # the longest tail that is a proper prefix of some stop string

    def step(self, delta: str) -> tuple[str, bool]:
        buf = self._pending + delta
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            return buf[: min(hits)], True
        hold = max((k for s in self.stops for k in range(1, min(len(s), len(buf) + 1))
                    if buf.endswith(s[:k])), default=0)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Text held back, released when generation ends for another reason."""
        pending, self._pending = self._pending, ""
        return pending


class OutputProcessor:
    """One request's text. ``process(token_ids)`` -> (new text, True if a stop string ended it)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = StopStringMatcher(params.stop) if params.stop else None
        self._min_tokens = params.min_tokens
        self.num_tokens = 0

    def process(self, token_ids: list[int]) -> tuple[str, bool]:
        parts = []
        for token_id in token_ids:
            self.num_tokens += 1
            delta = self._detok.step(token_id)
            if self._stop is None:
                parts.append(delta)
                continue
            if self.num_tokens <= self._min_tokens:  # not checked yet: release everything
                parts.append(self._stop.flush() + delta)
                continue
            text, stopped = self._stop.step(delta)
            parts.append(text)
            if stopped:
                return "".join(parts), True
        return "".join(parts), False

    def flush(self) -> str:
        return self._stop.flush() if self._stop else ""
