"""The OpenAI contract with no network, against OpenAI's own OpenAPI document (vendored,
``tests/data/openai-openapi``): every field of its request schemas is honoured or refused on
purpose (the refusal list below, with reasons, can only shrink deliberately); null means absent;
the developer role renders as the system role; the four prompt forms; and every response shape
the gateway builds validates against the specification's response schemas."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from services.api import gateway_pb2
from services.gateway.openai_api import (CHAT_REFUSED, COMPLETION_REFUSED, MESSAGE_REFUSED,
                                         STREAM_OPTIONS_REFUSED, TEXT_PART_REFUSED,
                                         ChatCompletionRequest, CompletionRequest)
from services.gateway.openai_responses import Chunker, error_body
from services.gateway.validation import template_messages
from tests.openai_spec import completion_chunk_validator, properties, spec, validator

VLLM_EXTRAS = {"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
               "structured_outputs", "prompt_logprobs"}

# The specification's fields Tandem refuses (400 naming the field), each with its reason. A field
# leaves this list only when it is honoured; a refresh of the vendored document that adds a field
# fails test_every_field_of_the_specification_is_honoured_or_refused until it is one or the other.
FUNCTIONS = "the deprecated function-calling fields: send tools and tool_choice instead"
STORED = "Tandem stores no completions (OpenAI's stored-completions API)"
END_USER = ("Tandem keeps no per-end-user accounting or abuse monitoring that an end-user "
            "identifier would feed")
REFUSED_CHAT = {
    "audio": "the model produces text only, no audio",
    "modalities": "the model produces text only, no audio",
    "prediction": "predicted outputs are not implemented",
    "functions": FUNCTIONS,
    "function_call": FUNCTIONS,
    "web_search_options": "Tandem has no web search",
    "reasoning_effort": "the model does not reason before answering",
    "verbosity": "the model has no verbosity control",
    "service_tier": "Tandem has one service tier (flex, scale, priority and fast do not exist here)",
    "store": STORED,
    "metadata": STORED + " to attach metadata to",
    "moderation": "Tandem runs no moderation model",
    "user": END_USER,
    "safety_identifier": END_USER,
    "prompt_cache_key": "the prefix cache is keyed by the prompt's own KV blocks; a client-chosen "
                        "cache key is not used",
    "prompt_cache_retention": "cached KV blocks live in worker memory until evicted; longer "
                              "retention does not exist",
    "prompt_cache_options": "the prefix cache has no client-set options",
}
REFUSED_COMPLETIONS = {
    "suffix": "the model does not fill in the middle (no suffix)",
    "best_of": "best_of > n (ranking candidates server-side) is not implemented; best_of equal "
               "to n is accepted",
    "user": END_USER,
}
# values of refused fields that ask for nothing, and so are accepted
NOOPS_CHAT = {"modalities": ["text"], "response_format": {"type": "text"}, "tools": [],
              "tool_choice": "none", "function_call": "none", "logit_bias": {},
              "reasoning_effort": "none", "service_tier": "auto", "store": False, "metadata": {},
              "prompt_cache_retention": "in_memory"}
NOOPS_COMPLETIONS = {"echo": False, "suffix": "", "best_of": 1, "logit_bias": {}}

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


# inside a request: keys of a message (any role), of a text part, of stream_options
REFUSED_MESSAGE_KEYS = {
    "name": "the chat template has no place for a participant's name",
    "audio": "the model reads and writes text only",
    "function_call": FUNCTIONS,
}
REFUSED_TEXT_PART_KEYS = {"prompt_cache_breakpoint": "the prefix cache has no client-set breakpoints"}
REFUSED_STREAM_OPTIONS = {"include_obfuscation": "Tandem does not pad stream events with random characters"}
# and whole kinds: the function role (FUNCTIONS), content parts other than text (and an
# assistant's refusal parts): image_url, input_audio, file (the model reads text only)
HONOURED_MESSAGE_KEYS = {"role", "content", "refusal", "tool_calls", "tool_call_id"}  # refusal: an
# assistant's, as its text


def reasons(table: dict) -> dict[str, str]:
    return {name: rule.reason for name, rule in table.items()}


def test_the_refusal_list_is_exactly_this():
    assert reasons(CHAT_REFUSED) == REFUSED_CHAT
    assert reasons(COMPLETION_REFUSED) == REFUSED_COMPLETIONS
    assert reasons(MESSAGE_REFUSED) == REFUSED_MESSAGE_KEYS
    assert reasons(TEXT_PART_REFUSED) == REFUSED_TEXT_PART_KEYS
    assert reasons(STREAM_OPTIONS_REFUSED) == REFUSED_STREAM_OPTIONS


def test_every_key_inside_a_request_is_honoured_or_refused():
    for role in ("Developer", "System", "User", "Assistant"):
        keys = properties(f"ChatCompletionRequest{role}Message")
        assert keys - HONOURED_MESSAGE_KEYS <= set(REFUSED_MESSAGE_KEYS), role
    assert properties("ChatCompletionRequestMessageContentPartText") - {"type", "text"} == set(REFUSED_TEXT_PART_KEYS)
    stream_options = spec()["components"]["schemas"]["ChatCompletionStreamOptions"]["anyOf"][0]["properties"]
    assert set(stream_options) - {"include_usage"} == set(REFUSED_STREAM_OPTIONS)


@pytest.mark.parametrize("cls,schema,refused", [
    (ChatCompletionRequest, "CreateChatCompletionRequest", REFUSED_CHAT),
    (CompletionRequest, "CreateCompletionRequest", REFUSED_COMPLETIONS),
])
def test_every_field_of_the_specification_is_honoured_or_refused(cls, schema, refused):
    spec_fields = properties(schema)
    ours = set(cls.model_fields)
    assert spec_fields - ours == set(), "fields of the specification neither honoured nor refused"
    assert ours - spec_fields == VLLM_EXTRAS  # nothing else is accepted
    assert set(refused) <= spec_fields


@pytest.mark.parametrize("cls,base,refused", [
    *((ChatCompletionRequest, CHAT, name) for name in REFUSED_CHAT),
    *((CompletionRequest, COMPLETION, name) for name in REFUSED_COMPLETIONS),
])
def test_a_refused_field_is_refused_naming_it(cls, base, refused):
    req = cls.model_validate_json(json.dumps({**base, refused: {"type": "anything"}}))
    with pytest.raises(ValueError, match=rf"^{refused}: "):
        req.to_protos("r")


@pytest.mark.parametrize("cls,base,name,value", [
    *((ChatCompletionRequest, CHAT, name, value) for name, value in NOOPS_CHAT.items()),
    *((CompletionRequest, COMPLETION, name, value) for name, value in NOOPS_COMPLETIONS.items()),
])
def test_values_that_ask_for_nothing_are_accepted(cls, base, name, value):
    plain = cls.model_validate_json(json.dumps(base)).to_protos("r")
    assert cls.model_validate_json(json.dumps({**base, name: value})).to_protos("r") == plain


@pytest.mark.parametrize("cls,schema,base", [
    (ChatCompletionRequest, "CreateChatCompletionRequest", CHAT),
    (CompletionRequest, "CreateCompletionRequest", COMPLETION),
])
def test_null_is_absent_for_every_optional_field(cls, schema, base):
    nulls = {name: None for name in properties(schema) if name not in base}
    plain = cls.model_validate_json(json.dumps(base)).to_protos("r")
    assert cls.model_validate_json(json.dumps({**base, **nulls})).to_protos("r") == plain


def test_unknown_fields_and_wrong_types_are_refused_naming_them():
    import pydantic

    with pytest.raises(pydantic.ValidationError) as err:
        ChatCompletionRequest.model_validate_json(json.dumps({**CHAT, "temprature": 0.5}))
    assert err.value.errors()[0]["loc"] == ("temprature",)
    for field, value in (("n", "2"), ("stream", "true"), ("max_tokens", 1.5)):
        with pytest.raises(pydantic.ValidationError) as err:
            ChatCompletionRequest.model_validate_json(json.dumps({**CHAT, field: value}))
        assert err.value.errors()[0]["loc"] == (field,)


def test_seed_takes_any_int64_and_top_p_zero_keeps_the_top_token():
    def proto(**fields):
        return ChatCompletionRequest.model_validate({**CHAT, **fields}).to_protos("r")[0]

    assert proto(seed=-1).seed == 2**63 - 1 and proto(seed=5).seed == 5
    zero = proto(top_p=0)
    assert not zero.HasField("top_p") and zero.top_k == 1


@pytest.mark.parametrize("message,where", [
    ({"role": "user", "content": "x", "name": "bob"}, "messages[0].name"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}, "messages[0].content[0].type"),
    ({"role": "user", "content": [{"type": "text", "text": "a", "prompt_cache_breakpoint": {}}]},
     "messages[0].content[0].prompt_cache_breakpoint"),
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "function", "content": "x", "name": "f"}, "messages[0].role"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, "messages[0].tool_calls[0].type"),
    ({"role": "user", "content": "x", "refusal": "no"}, "messages[0].refusal"),
    ({"role": "user"}, "messages[0].content"),
    ({"role": "user", "content": []}, "messages[0].content"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, "messages[0].content[0].type"),
    ({"role": "user", "content": [{"type": "file", "file": {}}]}, "messages[0].content[0].type"),
    ({"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}, "messages[0].content[0].type"),
])
def test_message_fields_tandem_does_not_honour_are_refused_naming_them(message, where):
    req = ChatCompletionRequest.model_validate({**CHAT, "messages": [message]})
    with pytest.raises(ValueError, match=f"^{re.escape(where)}: "):
        req.to_protos("r")


def test_message_contents_become_text():
    req = ChatCompletionRequest.model_validate({**CHAT, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "", "name": None},
        {"role": "assistant", "content": None, "refusal": "I can't.", "tool_calls": []},
        {"role": "assistant", "content": [{"type": "text", "text": "No: "}, {"type": "refusal", "refusal": "never"}]},
    ]})
    assert [(m.role, m.content) for m in req.to_protos("r")[0].messages] == [
        ("developer", "Be brief."), ("user", ""), ("assistant", "I can't."), ("assistant", "No: never")]


def test_developer_is_the_system_role_unless_the_template_knows_it():
    msgs = [gateway_pb2.ChatMessage(role="developer", content="Be brief."),
            gateway_pb2.ChatMessage(role="user", content="hi")]
    chatml = SimpleNamespace(chat_template="{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}")
    assert [m["role"] for m in template_messages(msgs, chatml)] == ["system", "user"]
    harmony = SimpleNamespace(chat_template="{% if m.role == 'developer' %}# Instructions{% endif %}")
    assert [m["role"] for m in template_messages(msgs, harmony)] == ["developer", "user"]
    with pytest.raises(ValueError, match=r"^messages\[0\]\.role: 'robot'"):
        template_messages([gateway_pb2.ChatMessage(role="robot", content="x")], chatml)


@pytest.mark.parametrize("prompt,expected", [
    ("Hello", [{"prompt": "Hello"}]),
    (["a", "b"], [{"prompt": "a"}, {"prompt": "b"}]),
    ([1, 2, 3], [{"prompt_token_ids": [1, 2, 3]}]),
    ([[1, 2], [3]], [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]),
    (None, [{"prompt": "<|endoftext|>"}]),  # the specification's default: a new document
])
def test_the_four_prompt_forms(prompt, expected):
    protos = CompletionRequest.model_validate({"prompt": prompt}).to_protos("r")
    got = [{"prompt": p.prompt} if p.prompt else {"prompt_token_ids": list(p.prompt_token_ids)} for p in protos]
    assert got == expected


@pytest.mark.parametrize("prompt,where", [
    ([], "prompt"), ([1, "a"], "prompt[0]"), ([[1], []], "prompt[1]"), ([[1], [-1]], "prompt[1][0]"),
    ({"text": "x"}, "prompt"),
])
def test_malformed_prompts_are_refused_naming_the_part(prompt, where):
    with pytest.raises(ValueError, match=f"^{re.escape(where)}: "):
        CompletionRequest.model_validate({"prompt": prompt}).to_protos("r")


# --- responses against the specification's response schemas ---------------------------------

def logprob(text: str) -> gateway_pb2.TokenLogprob:
    return gateway_pb2.TokenLogprob(text=text, logprob=-0.5, top_logprobs=[
        gateway_pb2.TopLogprob(text=text, logprob=-0.5), gateway_pb2.TopLogprob(text="?", logprob=-3.0)])


def responses(with_logprobs: bool) -> list[gateway_pb2.GenerateResponse]:
    lps = (lambda t: [logprob(t)]) if with_logprobs else (lambda t: [])
    return [gateway_pb2.GenerateResponse(text="Hel", logprobs=lps("Hel")),
            gateway_pb2.GenerateResponse(text="lo", finish_reason="length", logprobs=lps("lo"),
                                         usage=gateway_pb2.Usage(prompt_tokens=3, completion_tokens=2,
                                                                 total_tokens=5, cached_tokens=0))]


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_chat_responses_validate_against_the_specification(with_logprobs):
    whole = Chunker("chat", "r", "m", n=2).whole([responses(with_logprobs), responses(with_logprobs)])
    validator("CreateChatCompletionResponse").validate(whole)
    streamed = Chunker("chat", "r", "m", n=2)
    chunks = [streamed.chunk(i, msg) for msg in responses(with_logprobs) for i in (0, 1)]
    chunks.append(streamed.usage_chunk())
    for chunk in chunks:
        validator("CreateChatCompletionStreamResponse").validate(chunk)
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["choices"] == []


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_completion_responses_validate_against_the_specification(with_logprobs):
    batch = Chunker("completion", "r", "m", n=1, num_prompts=2)
    whole = batch.whole([responses(with_logprobs), responses(with_logprobs)])
    validator("CreateCompletionResponse").validate(whole)
    assert whole["usage"]["prompt_tokens"] == 6  # two prompts of 3 tokens
    streamed = Chunker("completion", "r", "m")
    chunks = [streamed.chunk(0, msg) for msg in responses(with_logprobs)] + [streamed.usage_chunk()]
    validator("CreateCompletionResponse").validate(chunks[-1])
    validator("CreateCompletionResponse").validate(chunks[-2])  # the last one has its reason
    for chunk in chunks:
        completion_chunk_validator().validate(chunk)


def test_errors_validate_against_the_specification():
    for status in (400, 404, 405, 413, 415, 422, 429, 500, 503):
        validator("ErrorResponse").validate(error_body("n: too many", status, "n", "some_code"))
        validator("ErrorResponse").validate(error_body("too many", status))
    assert error_body("n: too many", 400, "n")["error"]["param"] == "n"
