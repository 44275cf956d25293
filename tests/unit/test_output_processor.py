"""Stop strings across token boundaries, held back and never emitted."""
from __future__ import annotations

import pytest

from services.engine.output_processor import OutputProcessor, StopStringMatcher
from services.engine.sampling_params import SamplingParams
from tests.reference import tokenizer


def feed(matcher: StopStringMatcher, deltas: list[str]) -> tuple[list[str], bool]:
    out = []
    for d in deltas:
        text, stopped = matcher.step(d)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


@pytest.mark.parametrize("deltas,stops,emitted,stopped", [
    (["Hello", " wor", "ld", "!"], ("world",), ["Hello", " ", ""], True),  # spans 2 deltas
    (["ab", "c", "d"], ("bcd", "cx"), ["a", "", ""], True),
    (["The end", ".\n", "More"], ("\n\n",), ["The end", ".", "\nMore", ""], False),  # held then released
    (["xy", "z"], ("yz", "xyz"), ["", ""], True),  # earliest occurrence wins: nothing before "xyz"
    (["no stop here"], ("STOP",), ["no stop here", ""], False),
])
def test_stop_string_matcher(deltas, stops, emitted, stopped):
    out, was_stopped = feed(StopStringMatcher(stops), deltas)
    assert (out, was_stopped) == (emitted, stopped)


def test_output_processor_on_real_tokens_stops_across_token_boundaries():
    tok = tokenizer()
    ids = tok.encode("The capital of France is Paris. It is a big city.")
    stop = "aris. It"  # starts inside "Paris" and spans several tokens
    proc = OutputProcessor(tok, SamplingParams(stop=(stop,)))
    text, stopped = "", False
    for t in ids:
        delta, stopped = proc.process([t])
        text += delta
        if stopped:
            break
    assert stopped and text == "The capital of France is P"


def test_stop_strings_are_not_checked_before_min_tokens():
    tok = tokenizer()
    ids = tok.encode("stop stop stop")
    proc = OutputProcessor(tok, SamplingParams(stop=("stop",), min_tokens=2, max_tokens=10))
    texts = [proc.process([t]) for t in ids]
    assert texts[0] == ("stop", False) and texts[1] == (" stop", False)
    assert texts[2] == (" ", True)  # the space before the stop string is still text
