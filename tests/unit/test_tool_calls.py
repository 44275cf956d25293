"""services/gateway/tool_calls.py: tool calls read out of a model's text, whole or streamed in
pieces of any size (a stream splits tags and JSON anywhere)."""
from __future__ import annotations

import json

import pytest

from services.gateway.tool_calls import ArrayParser, HermesParser, NamedParser, parser_for

TEXT = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '</tool_call> and <tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
        ' done <tool')


def run(parser, text: str, piece: int, tags_in_content: bool = False) -> tuple[str, list[dict]]:
    """Feed ``text`` in pieces of ``piece`` characters; (all content, all deltas)."""
    content, deltas = "", []
    for i in range(0, len(text), piece):
        c, d = parser.feed(text[i:i + piece])
        if not tags_in_content:  # no tag, nor the start of one, reaches the client early
            assert "<tool_call>" not in c and not c.endswith("<")
        content += c
        deltas += d
    c, d = parser.finish()
    return content + c, deltas + d


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_hermes_calls_are_the_same_however_the_text_is_split(piece):
    content, deltas = run(HermesParser(), TEXT, piece)
    assert content == "Let me check.  and  done <tool"  # a tag start never closed is content
    assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"]))
            for d in deltas] == [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {"tz": "CET"})]
    assert all(d["id"].startswith("call_") and d["type"] == "function" for d in deltas)


def test_hermes_block_that_is_not_a_call_stays_content_as_written():
    text = "a <tool_call>not json</tool_call> b <tool_call>{\"x\": 1}</tool_call>"
    assert run(HermesParser(), text, 4, tags_in_content=True) == (text, [])


def test_hermes_unclosed_block_is_a_call_if_its_json_is_whole_else_content():
    content, deltas = run(HermesParser(), '<tool_call>{"name": "f", "parameters": {"a": 1}}', 5)
    assert content == "" and deltas[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert run(HermesParser(), '<tool_call>{"name": "f", "argu', 5) == ('<tool_call>{"name": "f", "argu', [])


def test_named_call_streams_its_arguments_and_names_the_function_once():
    p = NamedParser("get_weather")
    _, first = p.feed('{"city"')
    _, second = p.feed(': "Oslo"}')
    assert first[0]["function"] == {"name": "get_weather", "arguments": '{"city"'} and "id" in first[0]
    assert second == [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]
    assert p.calls[0].arguments == '{"city": "Oslo"}' and p.calls[0].id == first[0]["id"]


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_required_array_sends_each_call_once_it_is_whole(piece):
    text = '[{"name": "a", "parameters": {"x": [1, 2]}}, {"name": "b", "parameters": {}}]'
    content, deltas = run(ArrayParser(), text, piece)
    assert content == ""
    assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
        (0, "a", '{"x": [1, 2]}'), (1, "b", "{}")]


def test_parser_for_each_tool_choice():
    assert isinstance(parser_for("auto", None), HermesParser)
    assert isinstance(parser_for("required", None), ArrayParser)
    assert isinstance(parser_for("auto", "f"), NamedParser)
    assert parser_for("none", None) is None and parser_for(None, None) is None
