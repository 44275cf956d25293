"""Issue 29's OpenAI surface against a real stack (gateway with HTTP, one prefill and one decode
worker, Redis; float32 oracle mode, the default precision where seeded outputs are compared) through the official ``openai`` client: structured outputs
(20 JSON schemas, streaming and not, n=3, every output valid on the first try; a regex; a
choice), tool calling (named and required calls always parse; a round trip through a tool
result), ``echo`` + ``logprobs`` equal to transformers' log-softmax (the prefill worker
computes them and the gateway merges them), ``max_tokens: 0`` scoring, ``logit_bias``,
``/tokenize``, ``/detokenize``, ``/v1/responses``, ``/v1/models``, and lm-evaluation-harness's
``local-completions`` scoring a small local task."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch

from tests.integration.conftest import HttpStack, assert_all_blocks_freed, http_stack_with
from tests.reference import tokenizer

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
CONCURRENCY = 6  # requests in flight at once (x3 choices): within the small test KV cache
TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval_task"


@pytest.fixture(scope="module")
def http_stack(redis_server) -> Iterator[HttpStack]:
    with http_stack_with(redis_server.url, ["--max-n", "4"]) as s:
        yield s


@pytest.fixture(scope="module")
def default_precision_stack() -> Iterator[HttpStack]:
    """The default precision (the file's Q4_1, int8 activations): the one whose rows do not
    depend on the batch or the cache (docs/architecture.md, "Same input, same output"), so a
    seeded request gives the same text whoever shares its steps. The float32 oracle runs
    torch's matmuls, whose sums follow the batch's shape. Its own Redis: two stacks on one
    would register the same worker names."""
    with http_stack_with(None, ["--max-n", "4"],
                         ["--dtype", "auto", "--quantization", "auto"]) as s:
        yield s


def run(coro):
    return asyncio.run(coro)


def s(**props) -> dict:
    """A string property with a length bound (a 135M model sampling at temperature 1 may
    otherwise write one string until max_tokens)."""
    return {"type": "string", "maxLength": props.pop("maxLength", 24), **props}


def obj(required: bool = True, **props) -> dict:
    return {"type": "object", "properties": props, **({"required": list(props)} if required else {})}


INT = {"type": "integer", "minimum": 0, "maximum": 100}
SCHEMAS = [
    obj(name=s(), age={"type": "integer", "minimum": 0, "maximum": 120}),
    obj(city=s(), country=s(), population={"type": "integer", "minimum": 1, "maximum": 40000000}),
    obj(color={"enum": ["red", "green", "blue"]}, count={"type": "integer", "minimum": 1, "maximum": 9}),
    obj(tags={"type": "array", "items": s(maxLength=12), "minItems": 1, "maxItems": 4}),
    obj(point=obj(x=INT, y=INT), label=s()),
    obj(ok={"type": "boolean"}, reason=s()),
    obj(title=s(), year={"type": "integer", "minimum": 1900, "maximum": 2030},
        genre={"enum": ["drama", "comedy", "horror", "documentary"]}),
    obj(scores={"type": "array", "items": INT, "minItems": 2, "maxItems": 5}),
    obj(user=obj(id=INT, email=s(maxLength=30)), active={"type": "boolean"}),
    obj(level={"enum": ["low", "medium", "high"]}, value={"type": "number", "minimum": 0, "maximum": 1}),
    obj(items={"type": "array", "maxItems": 3, "items": obj(name=s(maxLength=12), qty=INT)}),
    obj(answer={"enum": ["yes", "no"]}, confidence={"type": "integer", "minimum": 0, "maximum": 10}),
    obj(a=obj(b=obj(c={"type": "integer", "minimum": -5, "maximum": 5}))),
    obj(required=False, nickname=s(), lucky_number=INT),
    {**obj(name=s(), email=s(maxLength=30), phone=s(maxLength=15)), "required": ["name"]},
    obj(weekday={"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}, hour={"type": "integer", "minimum": 0, "maximum": 23}),
    obj(matrix={"type": "array", "maxItems": 2, "items": {"type": "array", "items": INT, "minItems": 2, "maxItems": 2}}),
    obj(status={"enum": ["active", "inactive"]}, since={"type": "integer", "minimum": 2000, "maximum": 2025},
        notes={"type": "array", "items": s(maxLength=16), "maxItems": 2}),
    obj(lat={"type": "number", "minimum": -90, "maximum": 90}, lon={"type": "number", "minimum": -180, "maximum": 180}),
    obj(book=obj(title=s(), pages={"type": "integer", "minimum": 1, "maximum": 2000}),
        author=obj(name=s(), born={"type": "integer", "minimum": 1500, "maximum": 2010})),
]


def ask_json(schema: dict) -> list[dict]:
    return [{"role": "user", "content": f"Answer with a JSON object of this schema: {json.dumps(schema)}"}]


def test_twenty_json_schemas_validate_on_the_first_try_streaming_and_not(default_precision_stack):
    http_stack = default_precision_stack
    assert len({json.dumps(x, sort_keys=True) for x in SCHEMAS}) == 20
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(client, i: int, schema: dict, stream: bool) -> list[tuple[str, str]]:
        args = dict(model=MODEL, messages=ask_json(schema), n=3, seed=i, max_tokens=300,
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        async with gate:
            if not stream:
                r = await client.chat.completions.create(**args)
                return [(c.message.content, c.finish_reason) for c in r.choices]
            texts, reasons = ["", "", ""], [None] * 3
            async for chunk in await client.chat.completions.create(stream=True, **args):
                for c in chunk.choices:
                    texts[c.index] += c.delta.content or ""
                    reasons[c.index] = c.finish_reason or reasons[c.index]
            return list(zip(texts, reasons))

    async def all_of_them():
        client = http_stack.client()
        return await asyncio.gather(*(one(client, i, schema, stream) for i, schema in enumerate(SCHEMAS)
                                      for stream in (False, True)))

    results = run(all_of_them())
    for k, choices in enumerate(results):
        schema = SCHEMAS[k // 2]
        assert len(choices) == 3
        for text, reason in choices:
            assert reason == "stop", (schema, text)
            jsonschema.validate(json.loads(text), schema)
    # a seeded choice is the same whether streamed or not
    assert [r for r in results[0::2]] == [r for r in results[1::2]]
    run(assert_all_blocks_freed(http_stack.stack, timeout_s=60))


def test_regex_and_choice_hold_streaming_and_not(http_stack):
    async def both():
        client = http_stack.client()
        out = []
        for extra in ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
                      {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}):
            args = dict(model=MODEL, n=3, seed=5, max_tokens=20, extra_body=extra,
                        messages=[{"role": "user", "content": "Give me a phone number, or say yes."}])
            whole = await client.chat.completions.create(**args)
            streamed = ["", "", ""]
            async for chunk in await client.chat.completions.create(stream=True, **args):
                for c in chunk.choices:
                    streamed[c.index] += c.delta.content or ""
            out.append(([c.message.content for c in whole.choices], streamed))
        completion = await client.completions.create(
            model=MODEL, prompt="My favourite colour is", max_tokens=10, n=2, seed=1,
            extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
        return out, [c.text for c in completion.choices]

    (regex, choice), completion = run(both())
    for texts in regex:
        assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) for t in texts), texts
    for texts in choice:
        assert all(t in ("yes", "no", "maybe") for t in texts), texts
    assert regex[0] == regex[1] and choice[0] == choice[1]
    assert all(t in ("red", "green", "blue") for t in completion), completion


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


def check_call(call, tools=(WEATHER, TIME)) -> dict:
    spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, spec["parameters"])
    assert call.type == "function" and call.id
    return args


async def streamed_calls(stream) -> tuple[dict, str | None, str]:
    """Accumulate a stream's tool-call deltas as OpenAI's clients do: by index, arguments
    appended."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    async for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                if d.function and d.function.name:
                    entry["name"] = d.function.name
                if d.function and d.function.arguments:
                    entry["arguments"] += d.function.arguments
    return calls, reason, content


def test_named_and_required_tool_choices_always_produce_a_parseable_call(http_stack):
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def calls():
        client = http_stack.client()
        args = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], n=3, seed=2, max_tokens=120)
        by_name = await client.chat.completions.create(tool_choice=named, **args)
        required = await client.chat.completions.create(tool_choice="required", **args)
        single = await client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **args)
        stream = await client.chat.completions.create(tool_choice=named, stream=True, **{**args, "n": 1})
        return by_name, required, single, await streamed_calls(stream)

    by_name, required, single, (streamed, reason, content) = run(calls())
    for c in by_name.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather"
        check_call(call)
    for c in required.choices + single.choices:
        # parallel calls are not bounded (as OpenAI's): a choice may run into max_tokens, and
        # every call it made is still whole and valid
        assert c.finish_reason in ("tool_calls", "length") and c.message.tool_calls
        for call in c.message.tool_calls:
            check_call(call)
    assert all(c.finish_reason == "tool_calls" for c in single.choices)
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)
    (entry,) = streamed.values()
    assert reason == "tool_calls" and content == "" and entry["name"] == "get_weather" and entry["id"]
    jsonschema.validate(json.loads(entry["arguments"]), WEATHER["function"]["parameters"])
    # the streamed call is the same as choice 0 of the whole one (seed 2)
    assert json.loads(entry["arguments"]) == json.loads(by_name.choices[0].message.tool_calls[0].function.arguments)


def test_tool_calling_round_trip_streaming_and_not(http_stack):
    async def round_trip(stream: bool) -> tuple[str, str]:
        client = http_stack.client()
        args = dict(model=MODEL, tools=[WEATHER], max_tokens=60, temperature=0)
        first = await client.chat.completions.create(messages=ASK, tool_choice="required", **args)
        (call,) = first.choices[0].message.tool_calls
        check_call(call)
        messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id,
                           "content": json.dumps({"temperature": 21, "unit": "celsius", "sky": "sunny"})}]
        if not stream:
            answer = await client.chat.completions.create(messages=messages, **args)
            return answer.choices[0].message.content, answer.choices[0].finish_reason
        calls, reason, content = await streamed_calls(
            await client.chat.completions.create(messages=messages, stream=True, **args))
        assert not calls
        return content, reason

    whole, streamed = run(round_trip(False)), run(round_trip(True))
    assert whole == streamed  # greedy: the same answer either way
    text, reason = whole
    assert reason in ("stop", "length") and text and "<tool_call>" not in text
    # the tool's result reached the prompt: it is in what /tokenize renders for the same turn
    r = httpx.post(f"{http_stack.url}/tokenize", timeout=60, json={
        "model": MODEL, "tools": [WEATHER], "return_token_strs": True,
        "messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
                           {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21"}]})
    assert r.status_code == 200, r.text
    rendered = tokenizer().decode(r.json()["tokens"], skip_special_tokens=False)
    assert "<tool_response>\nsunny, 21\n</tool_response>" in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in rendered
    assert '"name": "get_weather"' in rendered.split("<|im_end|>")[0]  # the signature, in the system turn
    assert r.json()["count"] == len(r.json()["tokens"]) == len(r.json()["token_strs"])


def hf_log_softmax(ids: list[int]) -> torch.Tensor:
    from loadtest.hf_baseline import build_hf_model
    from services.engine.loader import load_model
    from services.engine.model_files import default_model_path

    model = build_hf_model(*load_model(default_model_path()))
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_echo_logprobs_equal_transformers_and_max_tokens_zero_scores(http_stack):
    prompt = "The quick brown fox jumps over the lazy dog. The capital of France is"
    ids = tokenizer().encode(prompt)

    async def score():
        client = http_stack.client()
        echo = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                               echo=True, logprobs=2)
        zero = await client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0)
        streamed = [c async for c in await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=2, stream=True)]
        vllm = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                               extra_body={"prompt_logprobs": 1})
        return echo, zero, streamed, vllm

    echo, zero, streamed, vllm = run(score())
    ref = hf_log_softmax(ids)
    (c,) = echo.choices
    lp = c.logprobs
    assert c.text.startswith(prompt) and len(lp.tokens) == len(ids) + 2
    assert "".join(lp.tokens[:len(ids)]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - ref[j - 1, ids[j]].item()) < 1e-4, j
        top = ref[j - 1].topk(2).indices.tolist()
        assert list(lp.top_logprobs[j]) == [tokenizer().decode([t], skip_special_tokens=False) for t in top]
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    (z,) = zero.choices
    assert z.finish_reason == "length" and z.text == prompt and zero.usage.completion_tokens == 0
    assert z.logprobs.token_logprobs[1:] == lp.token_logprobs[1:len(ids)]
    texts = [ch.choices[0].text for ch in streamed if ch.choices]
    assert "".join(texts) == c.text and texts[0].startswith(prompt)
    first = streamed[0].choices[0].logprobs
    assert first.token_logprobs[1:len(ids)] == lp.token_logprobs[1:len(ids)]
    pl = vllm.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for j in range(1, len(ids)):
        entry = pl[j][str(ids[j])]
        assert abs(entry["logprob"] - ref[j - 1, ids[j]].item()) < 1e-4
    run(assert_all_blocks_freed(http_stack.stack, timeout_s=60))


def test_logit_bias_bans_and_forces_tokens(http_stack):
    prompt = "The capital of France is"

    async def go():
        client = http_stack.client()
        args = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
        plain = await client.completions.create(**args)
        greedy = plain.choices[0].logprobs.tokens[0]
        greedy_id = tokenizer().encode(prompt + greedy)[len(tokenizer().encode(prompt))]
        banned = await client.completions.create(logit_bias={str(greedy_id): -100}, **args)
        forced_id = tokenizer().encode(" banana")[0]
        forced = await client.completions.create(logit_bias={str(forced_id): 100}, **args)
        bad = None
        try:
            await client.completions.create(logit_bias={str(tokenizer().vocab_size): 1}, **args)
        except openai.BadRequestError as exc:
            bad = exc.body
        return plain, greedy, banned, forced, forced_id, bad

    plain, greedy, banned, forced, forced_id, bad = run(go())
    assert banned.choices[0].text != plain.choices[0].text
    assert banned.choices[0].logprobs.tokens[0] != greedy
    assert forced.choices[0].logprobs.tokens == [tokenizer().decode([forced_id])] * 4
    assert bad is not None and bad["param"] == "logit_bias"


def test_tokenize_detokenize_models_and_responses(http_stack):
    text = "Hello, world!"
    r = httpx.post(f"{http_stack.url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenizer().encode(text) and r.json()["count"] == len(tokenizer().encode(text))
    assert r.json()["max_model_len"] == 8192 and r.json()["token_strs"] is None
    d = httpx.post(f"{http_stack.url}/detokenize", json={"model": MODEL, "tokens": r.json()["tokens"]}, timeout=60)
    assert d.status_code == 200 and d.json() == {"prompt": text}
    bad = httpx.post(f"{http_stack.url}/detokenize", json={"tokens": [1, 10**6]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    unknown = httpx.post(f"{http_stack.url}/tokenize", json={"prompt": "x", "add_special_tokens": False}, timeout=60)
    assert unknown.status_code == 400
    models = httpx.get(f"{http_stack.url}/v1/models", timeout=60).json()
    assert models["data"][0]["max_model_len"] == 8192

    async def responses():
        client = http_stack.client()
        whole = await client.responses.create(model=MODEL, input="What is the capital of France?",
                                              instructions="Answer briefly.", max_output_tokens=12,
                                              temperature=0)
        events = [e async for e in await client.responses.create(
            model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}],
            instructions="Answer briefly.", max_output_tokens=12, temperature=0, stream=True)]
        structured = await client.responses.create(
            model=MODEL, input="Describe a cat as JSON.", max_output_tokens=80, temperature=0,
            text={"format": {"type": "json_schema", "name": "cat", "schema": SCHEMAS[0], "strict": True}})
        refused = None
        try:
            await client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
        except openai.BadRequestError as exc:
            refused = exc.body
        return whole, events, structured, refused

    whole, events, structured, refused = run(responses())
    assert whole.output_text and whole.status in ("completed", "incomplete")
    assert whole.usage.output_tokens <= 12
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    jsonschema.validate(json.loads(structured.output_text), SCHEMAS[0])
    assert refused is not None and refused["param"] == "previous_response_id"


def test_lm_eval_local_completions_scores_a_local_task(http_stack, tmp_path):
    """lm-evaluation-harness (``lm_eval`` CLI, ``local-completions``: token-id prompts, echo,
    logprobs, max_tokens 1) scores the multiple-choice task in ``tests/data/lm_eval_task``."""
    # lm-eval tokenizes with transformers: the model's own tokenizer, saved as tokenizer.json
    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    tokenizer().backend.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
           f"model={MODEL},base_url={http_stack.base_url}/completions,tokenizer={tok_dir},"
           "num_concurrent=2,max_retries=1",
           "--tasks", "tandem_capitals", "--include_path", str(TASK_DIR), "--output_path", str(out),
           "--batch_size", "1", "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    # cwd: the task's data_files are relative to it
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=TASK_DIR, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(next(out.rglob("results_*.json")).read_text())["results"]["tandem_capitals"]
    assert result["sample_len"] == 8 and result["acc,none"] in [k / 8 for k in range(9)], result
    # each choice's log-likelihood is what transformers computes (float32 oracle)
    samples = [json.loads(line) for line in next(out.rglob("samples_tandem_capitals_*.jsonl")).open()]
    assert len(samples) == 8
    tok = tokenizer()
    for sample in samples[:2]:
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            ctx, whole = tok.encode(context), tok.encode(context + continuation)
            ref = hf_log_softmax(whole)
            expected = sum(ref[j - 1, whole[j]].item() for j in range(len(ctx), len(whole)))
            got = float(re.search(r"-?\d+\.\d+(e-?\d+)?", str(resp)).group())  # "(ll, is_greedy)"
            assert abs(got - expected) < 1e-3, (context, continuation, resp)
