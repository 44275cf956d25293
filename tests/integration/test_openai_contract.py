"""OpenAI's contract against the real stack (gateway with HTTP, prefill, decode, Redis), checked
with OpenAI's own OpenAPI document (vendored: ``tests/data/openai-openapi``).

- A schema-driven fuzzer (schemathesis, its CLI, coverage and fuzzing phases, a fixed seed,
  ``FUZZ_SECONDS`` long) over the operations Tandem serves: no server error and no response that
  breaks the specification's response schemas, streamed chunks included. One worker: with two,
  Hypothesis's generation broke now and then on CPython 3.11 (``ast.parse`` from two threads:
  "AST constructor recursion depth mismatch"), an error of the fuzzer, not of the server. It fuzzes the space
  Tandem accepts (the specification less the fields ``REFUSED`` lists, which the unit test
  ``test_openai_spec_fields.py`` covers, with ``model`` the served one and small ``max_tokens``);
  its deliberately broken requests (negative mode) must get no server error either.
- The request forms the specification allows, through the official ``openai`` client and raw
  HTTP: null for every optional field, the developer role, ``prompt`` in its four forms (batches
  ordered prompt by prompt, with ``n``), and OpenAI's error object off the served paths.
"""
from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import yaml

from services.gateway.openai_api import (CHAT_REFUSED, COMPLETION_REFUSED, MESSAGE_REFUSED,
                                         STREAM_OPTIONS_REFUSED, TEXT_PART_REFUSED)
from tests.integration.conftest import HttpStack, assert_all_blocks_freed, http_stack_with
from tests.openai_spec import (completion_chunk_validator, completion_validator, echo_logprobs,
                               spec, validator)
from tests.reference import tokenizer

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
MAX_N, MAX_TOKENS_CAP = 4, 8  # the stack's gateway limits
FUZZ_SECONDS = 120  # the fuzzer's whole budget (its --max-time)
FUZZ_SEED = 38  # fixed: a failure reproduces with the same requests
FUZZ_MAX_TOKENS = 4  # generated requests ask for at most this many tokens (CPU time)


@pytest.fixture(scope="module")
def http_stack(redis_server) -> Iterator[HttpStack]:
    with http_stack_with(redis_server.url, ["--max-n", str(MAX_N), "--max-tokens-cap", str(MAX_TOKENS_CAP)]) as s:
        yield s


def run(coro):
    return asyncio.run(coro)


# --- the fuzzer ------------------------------------------------------------------------------

def accepted_space() -> dict:
    """The vendored document narrowed to what Tandem accepts and can answer quickly: the served
    model, at most ``FUZZ_MAX_TOKENS`` tokens and 2 choices, token ids of the model's vocabulary,
    and none of the fields, message keys, roles or content parts that Tandem refuses. One
    response schema is relaxed: echoed logprobs' first token is null (``echo_logprobs``)."""
    doc = copy.deepcopy(spec())
    schemas = doc["components"]["schemas"]

    def props(name: str) -> dict:
        schema = schemas[name]
        return schema["allOf"][-1]["properties"] if "allOf" in schema else schema["properties"]

    served = {"type": "string", "enum": [MODEL]}
    few_tokens = {"type": "integer", "minimum": 1, "maximum": FUZZ_MAX_TOKENS}
    chat, completion = props("CreateChatCompletionRequest"), props("CreateCompletionRequest")
    for p in (chat, completion):
        p["model"], p["max_tokens"], p["n"] = served, few_tokens, {"type": "integer", "minimum": 1, "maximum": 2}
    chat["max_completion_tokens"] = few_tokens
    token_id = {"type": "integer", "minimum": 0, "maximum": tokenizer().vocab_size - 1}
    forms = completion["prompt"]["oneOf"]
    forms[2]["items"], forms[3]["items"]["items"] = token_id, token_id
    for name in ("CreateChatCompletionRequest", "CreateModelResponseProperties", "ModelResponseProperties"):
        for part in schemas[name].get("allOf", [schemas[name]]):
            for field in CHAT_REFUSED:
                part.get("properties", {}).pop(field, None)
    for field in COMPLETION_REFUSED:
        completion.pop(field, None)
    for key in STREAM_OPTIONS_REFUSED:
        schemas["ChatCompletionStreamOptions"]["anyOf"][0]["properties"].pop(key)
    schemas["ChatCompletionRequestMessage"]["oneOf"] = [
        v for v in schemas["ChatCompletionRequestMessage"]["oneOf"]
        if not v["$ref"].endswith("FunctionMessage")]
    for role in ("Developer", "System", "User", "Assistant"):
        for key in MESSAGE_REFUSED:
            schemas[f"ChatCompletionRequest{role}Message"]["properties"].pop(key, None)
    schemas["ChatCompletionRequestUserMessageContentPart"]["oneOf"] = [
        {"$ref": "#/components/schemas/ChatCompletionRequestMessageContentPartText"}]
    for key in TEXT_PART_REFUSED:
        schemas["ChatCompletionRequestMessageContentPartText"]["properties"].pop(key)
    choice = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]
    choice["logprobs"] = echo_logprobs(choice["logprobs"])  # the chunks' copy below too
    _streams_as_events(doc)
    return doc


def _streams_as_events(doc: dict) -> None:
    """Declare the 200 streams as OpenAI sends them, so that the fuzzer checks each chunk: an
    SSE event whose ``data`` is ``[DONE]`` or a JSON chunk (before OpenAPI 3.2, schemathesis
    reads a ``text/event-stream`` schema as the event's fields; OpenAI's document means the JSON
    in ``data``). Completions' chunks: ``CreateCompletionResponse`` with ``finish_reason`` null
    until a choice's last chunk (what OpenAI and vLLM send; see ``completion_chunk_validator``),
    a stream the document does not declare at all."""
    def events(chunk: dict) -> dict:
        data = {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json",
                                                "contentSchema": chunk}]}
        return {"schema": {"type": "object", "required": ["data"], "properties": {"data": data}}}

    schemas = doc["components"]["schemas"]
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    reason.update(type=["string", "null"], enum=[*reason["enum"], None])
    schemas["CompletionStreamChunk"] = chunk
    chat = doc["paths"]["/chat/completions"]["post"]["responses"]["200"]["content"]
    chat["text/event-stream"] = events(chat["text/event-stream"]["schema"])
    completions = doc["paths"]["/completions"]["post"]["responses"]["200"]["content"]
    completions["text/event-stream"] = events({"$ref": "#/components/schemas/CompletionStreamChunk"})


def sse_chunks(text: str) -> list[dict]:
    """The JSON events of an SSE body, ``[DONE]`` left out."""
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]", text[-200:]
    return [json.loads(e) for e in events[:-1]]


def check_streams(entries: list[dict]) -> int:
    """Validate every chunk of every streamed 200 in the HAR ``entries`` against the
    specification's chunk schemas (schemathesis checks whole responses only); the count of
    chunks checked."""
    checked = 0
    chat_chunk, completion_chunk = validator("CreateChatCompletionStreamResponse"), completion_chunk_validator()
    for e in entries:
        content = e["response"]["content"]
        if e["response"]["status"] != 200 or not content.get("mimeType", "").startswith("text/event-stream"):
            continue
        chunk_validator = chat_chunk if e["request"]["url"].endswith("/chat/completions") else completion_chunk
        for chunk in sse_chunks(content.get("text", "")):
            assert "error" not in chunk, chunk
            chunk_validator.validate(chunk)
            checked += 1
    return checked


def test_fuzzer_finds_no_server_error_and_no_schema_violation(http_stack, tmp_path):
    space = tmp_path / "openapi.yaml"
    space.write_text(yaml.safe_dump(accepted_space(), sort_keys=False))
    report = tmp_path / "report"
    st = Path(sys.executable).parent / "st"
    command = [str(st), "run", str(space), "--url", f"{http_stack.url}/v1",
               "--checks", "not_a_server_error,response_schema_conformance",
               "--phases", "coverage,fuzzing", "--max-time", str(FUZZ_SECONDS), "--seed", str(FUZZ_SEED),
               "--workers", "1", "--request-timeout", "120", "--report", "json,har",
               "--report-dir", str(report), "--no-color"]
    # cwd: schemathesis keeps a cache (.schemathesis/) in its working directory
    done = subprocess.run(command, capture_output=True, text=True, timeout=FUZZ_SECONDS + 600, cwd=tmp_path)
    summary = json.loads(next(report.glob("json-*.json")).read_text())
    entries = json.loads(next(report.glob("har-*.json")).read_text())["log"]["entries"]
    statuses = Counter((e["request"]["url"].rsplit("/v1", 1)[1], e["response"]["status"]) for e in entries)
    print(f"fuzzer: {summary['test_cases']['generated']} test cases, {len(entries)} requests in "
          f"{summary['running_time']:.0f} s; by (path, status): {dict(sorted(statuses.items()))}")
    assert done.returncode == 0 and not summary["failures"] and not summary["errors"], done.stdout[-6000:]
    assert not [k for k in statuses if k[1] >= 500], statuses
    # it reached the accepted space, not only the refusals (about 30 and 120 on a quiet machine;
    # a loaded one answers fewer within the budget)
    assert statuses[("/chat/completions", 200)] >= 3 and statuses[("/completions", 200)] >= 3, statuses
    assert check_streams(entries) > 0
    run(assert_all_blocks_freed(http_stack.stack, timeout_s=60))
    assert httpx.get(f"{http_stack.url}/ready", timeout=30).status_code == 200


# --- the request forms, through the official client and raw HTTP ----------------------------

CHAT_NULLS = {name: None for name in (
    "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "seed", "stop", "stream", "stream_options", "temperature", "top_p",
    "user", "tools", "tool_choice", "response_format", "audio", "modalities", "store", "metadata",
    "prediction", "service_tier", "reasoning_effort", "verbosity", "safety_identifier")}
COMPLETION_NULLS = {name: None for name in (
    "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "n", "presence_penalty",
    "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user")}


def post(http_stack: HttpStack, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{http_stack.url}/v1{path}", json=body, timeout=300, **kwargs)


def test_null_means_absent_over_raw_http_and_the_openai_client(http_stack):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi", "name": None}],
            "max_tokens": 4, "temperature": 0}
    plain_chat = post(http_stack, "/chat/completions", chat)
    nulls = post(http_stack, "/chat/completions", {**CHAT_NULLS, **chat})
    assert plain_chat.status_code == nulls.status_code == 200, nulls.text
    validator("CreateChatCompletionResponse").validate(nulls.json())
    assert nulls.json()["choices"][0]["message"] == plain_chat.json()["choices"][0]["message"]
    assert nulls.json()["choices"][0]["message"]["refusal"] is None
    completion = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    plain = post(http_stack, "/completions", completion)
    nulls = post(http_stack, "/completions", {**COMPLETION_NULLS, **completion})
    assert plain.status_code == nulls.status_code == 200, nulls.text
    validator("CreateCompletionResponse").validate(nulls.json())
    assert nulls.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]

    async def client_nulls():  # the official client sends an explicit None as null
        client = http_stack.client()
        nones = dict(n=None, stop=None, seed=None, top_p=None, logprobs=None, user=None,
                     presence_penalty=None, frequency_penalty=None, stream_options=None)
        c = await client.chat.completions.create(messages=chat["messages"], model=MODEL, max_tokens=4,
                                                 temperature=0, **nones)
        t = await client.completions.create(prompt=completion["prompt"], model=MODEL, max_tokens=4,
                                            temperature=0, echo=None, suffix=None, best_of=None, **nones)
        return c, t

    c, t = run(client_nulls())
    assert c.choices[0].message.content == plain_chat.json()["choices"][0]["message"]["content"]
    assert t.choices[0].text == plain.json()["choices"][0]["text"]


def test_echoed_logprobs_conform_with_the_first_token_null(http_stack):
    """The request the fuzzer found (seed 38, 2,265 cases in its 120 s on a fast machine):
    ``echo`` with ``logprobs`` over a batch of odd prompts. The first echoed token of each
    choice has null logprob and null alternatives, as OpenAI and vLLM send it; everything else
    conforms to the specification, whole responses and streamed chunks."""
    body = {"model": MODEL, "prompt": ["\r\u0091\u0093\u00ac=", "\u0010\u00d1"], "echo": True,
            "logprobs": 0, "max_tokens": 2, "temperature": 0, "top_p": 0.14}
    whole = post(http_stack, "/completions", body)
    assert whole.status_code == 200, whole.text
    completion_validator().validate(whole.json())
    for choice in whole.json()["choices"]:
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert None not in lp["token_logprobs"][1:] and None not in lp["top_logprobs"][1:]
    with pytest.raises(jsonschema.ValidationError):  # the document as written refuses them
        validator("CreateCompletionResponse").validate(whole.json())
    streamed = post(http_stack, "/completions", {**body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    chunks = sse_chunks(streamed.text)
    for chunk in chunks:
        completion_chunk_validator().validate(chunk)
    assert any(c["choices"] and c["choices"][0]["logprobs"]["token_logprobs"][0] is None
               for c in chunks)


def test_developer_role_is_the_system_role(http_stack):
    async def over_http(role: str):
        return await http_stack.client().chat.completions.create(
            model=MODEL, max_tokens=8, temperature=0, messages=[
                {"role": role, "content": "Answer in French."},
                {"role": "user", "content": "What is the capital of France?"}])

    developer, system = run(over_http("developer")), run(over_http("system"))
    assert developer.choices[0].message.content == system.choices[0].message.content
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    assert developer.choices[0].message.refusal is None


PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_the_four_prompt_forms_through_the_openai_client(http_stack):
    ids = [tokenizer().encode(p) for p in PROMPTS]
    args = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})

    async def over_http():
        client = http_stack.client()
        singles = [await client.completions.create(prompt=p, **args) for p in PROMPTS]
        forms = [await client.completions.create(prompt=prompt, **args)
                 for prompt in (PROMPTS[0], PROMPTS, ids[0], ids)]
        batch_n = await client.completions.create(prompt=PROMPTS, n=2, **args)
        stream = await client.completions.create(prompt=ids, n=2, stream=True, **args)
        streamed = ["", "", "", ""]
        async for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] += choice.text
        return singles, forms, batch_n, streamed

    singles, forms, batch_n, streamed = run(over_http())
    expected = [s.choices[0].text for s in singles]
    string, strings, token_ids, token_id_lists = forms
    assert [c.text for c in string.choices] == expected[:1]
    assert [c.text for c in token_ids.choices] == expected[:1]
    for batch in (strings, token_id_lists):  # one choice per prompt, in the prompts' order
        assert [c.index for c in batch.choices] == [0, 1]
        assert [c.text for c in batch.choices] == expected
        assert batch.usage.prompt_tokens == sum(len(i) for i in ids)
        assert batch.usage.completion_tokens == 12
    # n = 2 per prompt: index = prompt * n + j
    assert [c.index for c in batch_n.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch_n.choices] == [expected[0]] * 2 + [expected[1]] * 2
    assert streamed == [expected[0]] * 2 + [expected[1]] * 2
    run(assert_all_blocks_freed(http_stack.stack, timeout_s=30))


def test_the_four_prompt_forms_over_raw_http(http_stack):
    ids = [tokenizer().encode(p) for p in PROMPTS]
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    texts = []
    for prompt in (PROMPTS, ids[0], ids, PROMPTS[1]):
        r = post(http_stack, "/completions", {**body, "prompt": prompt})
        assert r.status_code == 200, r.text
        validator("CreateCompletionResponse").validate(r.json())
        texts.append([c["text"] for c in r.json()["choices"]])
    assert texts[0] == texts[2] and texts[1] == texts[0][:1] and texts[3] == texts[0][1:]
    with httpx.stream("POST", f"{http_stack.url}/v1/completions", timeout=300,
                      json={**body, "prompt": ids, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = sse_chunks(r.read().decode())
    for chunk in chunks:
        completion_chunk_validator().validate(chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    bad = post(http_stack, "/completions", {**body, "prompt": [ids[0], [tokenizer().vocab_size]]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt[1][0]", bad.text
    over = post(http_stack, "/completions", {**body, "prompt": PROMPTS * 3})  # 6 choices > max_n
    assert over.status_code == 400 and over.json()["error"]["param"] == "n", over.text


def test_refused_fields_are_400_naming_them_through_the_openai_client(http_stack):
    async def refused(**kwargs):
        with pytest.raises(openai.BadRequestError) as err:
            await http_stack.client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, **kwargs)
        return err.value.body

    for kwargs, param in (({"functions": [{"name": "f"}]}, "functions"),
                          ({"response_format": {"type": "json_schema", "json_schema": {
                              "name": "x", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
                          ({"logit_bias": {"49152": 5}}, "logit_bias"),
                          ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
                          ({"store": True}, "store"),
                          ({"extra_body": {"temprature": 0.5}}, "temprature")):
        body = run(refused(**kwargs))
        assert body["param"] == param and body["type"] == "invalid_request_error", body


@pytest.mark.parametrize("method,path,body,headers,status", [
    ("GET", "/v1/nothing-here", None, {}, 404),
    ("POST", "/v2/chat/completions", b"{}", {"content-type": "application/json"}, 404),
    ("DELETE", "/v1/models", None, {}, 405),
    ("GET", "/v1/chat/completions", None, {}, 405),
    ("POST", "/v1/chat/completions", b"model=x", {"content-type": "application/x-www-form-urlencoded"}, 415),
    ("POST", "/v1/completions", b"x" * (4 * 1024 * 1024 + 1), {"content-type": "application/json"}, 413),
])
def test_errors_off_the_served_paths_are_openai_errors(http_stack, method, path, body, headers, status):
    r = httpx.request(method, f"{http_stack.url}{path}", content=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    validator("ErrorResponse").validate(r.json())
    assert r.json()["error"]["type"] == "invalid_request_error"
    if status == 405:
        assert r.headers["allow"]
