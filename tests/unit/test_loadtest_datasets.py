"""bench serve's datasets: exact random lengths, shared prefixes, chat prompts, long-prompt mixes,
and ShareGPT files, including malformed ones (a clear error naming the entry)."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from loadtest.chat_prompts import CHAT_PROMPTS
from loadtest.datasets import DatasetOptions, build_dataset, load_sharegpt


class WordTokenizer:
    """One token per whitespace-separated word; ``w<ID>`` words round-trip to their id."""

    vocab_size = 1000

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) if re.fullmatch(r"w\d+", w) else 17 for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"<{m['role']}> {m['content']} " for m in messages) + "<assistant>"


TOK = WordTokenizer()


def test_random_lengths_are_exact_without_a_range_and_within_it_with_one():
    reqs = build_dataset("random", 20, TOK, DatasetOptions(input_len=50, output_len=12))
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(50, 12)}
    assert all(len(TOK.encode(r.prompt)) == 50 and r.ignore_eos and r.kind == "random" for r in reqs)
    ranged = build_dataset("random", 200, TOK, DatasetOptions(input_len=100, output_len=20,
                                                               range_ratio=0.5))
    assert {r.prompt_len for r in ranged} <= set(range(50, 151))
    assert {r.output_len for r in ranged} <= set(range(10, 31))
    assert len({r.prompt_len for r in ranged}) > 20  # actually varies


def test_datasets_are_seeded():
    opts = DatasetOptions(seed=4, input_len=30, range_ratio=0.3)
    assert build_dataset("random", 10, TOK, opts) == build_dataset("random", 10, TOK, opts)
    assert build_dataset("random", 10, TOK, opts) != build_dataset(
        "random", 10, TOK, DatasetOptions(seed=5, input_len=30, range_ratio=0.3))


def test_prefix_dataset_deals_documents_times_questions_shuffled():
    opts = DatasetOptions(prefix_len=40, input_len=10, num_prefixes=3, output_len=8)
    reqs = build_dataset("prefix", 9, TOK, opts)
    prefixes = [" ".join(r.prompt.split()[:40]) for r in reqs]
    assert sorted(Counter(prefixes).values()) == [3, 3, 3]  # 3 documents x 3 questions
    assert prefixes != sorted(prefixes, key=prefixes.index)  # not grouped: shuffled
    assert len({r.prompt for r in reqs}) == 9  # the questions differ
    assert all(r.prompt_len == 50 and r.kind == "prefix" for r in reqs)
    assert len(build_dataset("prefix", 7, TOK, opts)) == 7


def test_multiturn_dataset_resends_the_history_every_turn():
    opts = DatasetOptions(input_len=5, output_len=4, num_turns=3)
    reqs = build_dataset("multiturn", 6, TOK, opts)  # 2 conversations x 3 turns
    assert [len(r.messages) for r in reqs] == [1, 1, 3, 3, 5, 5]
    assert all(r.kind == "multiturn" and r.ignore_eos and r.output_len == 4 for r in reqs)
    by_first = {}
    for r in reqs:
        by_first.setdefault(r.messages[0]["content"], []).append(r)
    assert len(by_first) == 2
    for turns in by_first.values():
        for earlier, later in zip(turns, turns[1:]):
            assert later.messages[:len(earlier.messages)] == earlier.messages
            assert later.prompt.startswith(earlier.prompt[:-len("<assistant>")])
            assert later.messages[len(earlier.messages)]["role"] == "assistant"
    assert reqs[4].prompt == TOK.apply_chat_template(list(reqs[4].messages))
    with pytest.raises(ValueError, match="num_turns"):
        DatasetOptions(num_turns=0)


def test_chat_dataset_sends_the_built_in_prompts_as_one_user_turn_to_eos():
    reqs = build_dataset("chat", len(CHAT_PROMPTS), TOK, DatasetOptions(chat_max_tokens=77))
    assert sorted(r.messages[0]["content"] for r in reqs) == sorted(CHAT_PROMPTS)
    assert all(r.messages[0]["role"] == "user" and not r.ignore_eos and r.output_len == 77
               for r in reqs)
    assert reqs[0].prompt == TOK.apply_chat_template(list(reqs[0].messages))


def test_long_mix_replaces_a_fraction_of_chat_with_long_prompts():
    opts = DatasetOptions(long_fraction=0.3, long_input_range=(300, 400), long_output_len=5, seed=1)
    reqs = build_dataset("long-mix", 400, TOK, opts)
    long = [r for r in reqs if r.kind == "long"]
    assert 0.22 < len(long) / len(reqs) < 0.38
    assert all(300 <= r.prompt_len <= 400 and r.output_len == 5 and r.ignore_eos for r in long)
    assert {r.kind for r in reqs} == {"chat", "long"}


def _write(tmp_path, data) -> str:
    path = tmp_path / "sg.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_sharegpt_takes_first_turn_as_prompt_and_reply_length_as_output(tmp_path):
    path = _write(tmp_path, [
        {"id": "a", "conversations": [{"from": "human", "value": "hi there"},
                                      {"from": "gpt", "value": "one two three four"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "alone"}]},  # skipped
    ])
    assert load_sharegpt(path) == [("hi there", "one two three four")]
    reqs = build_dataset("sharegpt", 3, TOK, DatasetOptions(sharegpt_path=path))
    assert all(r.messages[0]["content"] == "hi there" and r.output_len == 4 for r in reqs)
    fixed = build_dataset("sharegpt", 1, TOK, DatasetOptions(sharegpt_path=path, sharegpt_output_len=9))
    assert fixed[0].output_len == 9


@pytest.mark.parametrize("data, message", [
    ("{not json", "not valid JSON"),
    ({"conversations": []}, "expected a JSON list"),
    ([{"conversations": []}, {"id": "x7", "turns": []}], r"entry 1 \(id 'x7'\): expected an object"),
    ([{"conversations": [{"from": "human", "value": 3}]}], r"entry 0: conversations\[0\]"),
    (["just a string"], "entry 0: expected an object"),
    ([{"conversations": [{"from": "human", "value": "a"}]}], "no entry has two turns"),
])
def test_malformed_sharegpt_is_a_value_error_naming_the_entry(tmp_path, data, message):
    with pytest.raises(ValueError, match=message):
        load_sharegpt(_write(tmp_path, data))


@pytest.mark.parametrize("name, opts, field", [
    ("nope", DatasetOptions(), "dataset"), ("sharegpt", DatasetOptions(), "sharegpt_path"),
])
def test_bad_dataset_choices_name_the_field(name, opts, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        build_dataset(name, 1, TOK, opts)


@pytest.mark.parametrize("fields, field", [
    (dict(input_len=0), "input_len"), (dict(range_ratio=1.0), "range_ratio"),
    (dict(long_fraction=1.5), "long_fraction"), (dict(long_input_range=(10, 5)), "long_input_range"),
])
def test_bad_dataset_options_name_the_field(fields, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        DatasetOptions(**fields)
