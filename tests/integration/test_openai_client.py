"""The official ``openai`` client against a real stack (`tandem serve gateway --http-port`,
prefill, decode, Redis): greedy chat and completions equal the gRPC API's (and so transformers'),
streaming and not; usage counts what was streamed; ``n`` choices equal single seeded requests;
logprobs, stop strings, max_completion_tokens and vLLM's extra fields; prefix-cache hits in
``usage.prompt_tokens_details.cached_tokens``; bad input as OpenAI errors naming ``param``."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

from services.api import gateway_pb2
from tests.integration.conftest import HttpStack, assert_all_blocks_freed, http_stack_with
from tests.integration.test_stack import generate
from tests.reference import CHAT_PROMPTS, NUM_TOKENS, chat_prompt_ids, hf_greedy_outputs

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16  # the engine's default
MAX_N, MAX_TOKENS_CAP = 4, 4096  # the stack's gateway limits
COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def http_stack(redis_server) -> Iterator[HttpStack]:
    with http_stack_with(redis_server.url, ["--max-n", str(MAX_N), "--max-tokens-cap", str(MAX_TOKENS_CAP)]) as s:
        yield s


def run(coro):
    return asyncio.run(coro)


def grpc_text(address: str, **fields) -> tuple[list[int], str, gateway_pb2.GenerateResponse]:
    return run(generate(address, gateway_pb2.GenerateRequest(**fields)))


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def test_chat_greedy_equals_grpc_and_transformers(http_stack):
    expected = []
    for prompt, reference in zip(CHAT_PROMPTS, hf_greedy_outputs()):
        tokens, text, _ = grpc_text(http_stack.stack.address, max_tokens=NUM_TOKENS, temperature=0.0,
                                    ignore_eos=True, messages=[gateway_pb2.ChatMessage(role="user", content=prompt)])
        assert tokens == list(reference), prompt
        expected.append(text)

    async def over_http():
        client = http_stack.client()
        args = dict(model=MODEL, max_tokens=NUM_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        whole = await asyncio.gather(*(client.chat.completions.create(messages=chat(p), **args)
                                       for p in CHAT_PROMPTS))
        streamed = []
        for p in CHAT_PROMPTS:
            stream = await client.chat.completions.create(messages=chat(p), stream=True, **args)
            streamed.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))
        return whole, streamed

    whole, streamed = run(over_http())
    assert [r.choices[0].message.content for r in whole] == expected
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == NUM_TOKENS
               for r in whole)
    assert [r.usage.prompt_tokens for r in whole] == [len(chat_prompt_ids(p)) for p in CHAT_PROMPTS]
    assert streamed == expected
    run(assert_all_blocks_freed(http_stack.stack, timeout_s=30))


def test_completions_greedy_equals_grpc(http_stack):
    expected = [grpc_text(http_stack.stack.address, prompt=p, max_tokens=12, temperature=0.0,
                          ignore_eos=True)[1] for p in COMPLETION_PROMPTS]

    async def over_http():
        client = http_stack.client()
        args = dict(model=MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        whole = [await client.completions.create(prompt=p, **args) for p in COMPLETION_PROMPTS]
        streamed = []
        for p in COMPLETION_PROMPTS:
            stream = await client.completions.create(prompt=p, stream=True, **args)
            streamed.append("".join([c.choices[0].text async for c in stream if c.choices]))
        return whole, streamed

    whole, streamed = run(over_http())
    assert [r.choices[0].text for r in whole] == expected
    assert streamed == expected
    assert {r.object for r in whole} == {"text_completion"}


def test_include_usage_counts_the_tokens_streamed(http_stack):
    async def over_http():
        stream = await http_stack.client().chat.completions.create(
            model=MODEL, messages=chat(CHAT_PROMPTS[2]), max_tokens=12, temperature=0, logprobs=True,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        return [c async for c in stream]

    chunks = run(over_http())
    streamed = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert last.usage.completion_tokens == streamed == 12
    assert last.usage.prompt_tokens == len(chat_prompt_ids(CHAT_PROMPTS[2]))
    assert last.usage.total_tokens == last.usage.prompt_tokens + 12


def test_n_choices_equal_single_requests_with_seeds(http_stack):
    args = dict(model=MODEL, messages=chat(CHAT_PROMPTS[1]), max_tokens=16, temperature=1.0,
                extra_body={"ignore_eos": True})

    async def over_http():
        client = http_stack.client()
        together = await client.chat.completions.create(n=3, seed=1234, **args)
        stream = await client.chat.completions.create(n=3, seed=1234, stream=True, **args)
        streamed = ["", "", ""]
        async for c in stream:
            for choice in c.choices:
                streamed[choice.index] += choice.delta.content or ""
        singles = [await client.chat.completions.create(seed=1234 + i, **args) for i in range(3)]
        return together, streamed, singles

    together, streamed, singles = run(over_http())
    texts = [c.message.content for c in sorted(together.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(together.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [s.choices[0].message.content for s in singles]
    assert len(set(texts)) == 3, texts  # seeds seed, seed+1, seed+2: three different samples
    assert streamed == texts
    assert together.usage.completion_tokens == 3 * 16
    assert together.usage.prompt_tokens == len(chat_prompt_ids(CHAT_PROMPTS[1]))
    run(assert_all_blocks_freed(http_stack.stack, timeout_s=30))


def test_greedy_n_choices_are_equal_and_completions_take_n(http_stack):
    async def over_http():
        return await http_stack.client().completions.create(
            model=MODEL, prompt=COMPLETION_PROMPTS[0], n=2, max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True})

    r = run(over_http())
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].text == r.choices[1].text and r.usage.completion_tokens == 12


def test_prefix_cache_hits_are_cached_tokens(http_stack):
    prompt = "Summarise this list: " + ", ".join(f"item {i}" for i in range(40))

    async def twice():
        client = http_stack.client()
        return [await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
                for _ in range(2)]

    first, second = run(twice())
    n = second.usage.prompt_tokens
    assert n > 3 * BLOCK_SIZE
    # every full block but the one holding the last prompt token (recomputed for its logits)
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert first.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens_details.cached_tokens


def test_logprobs_in_openai_shape(http_stack):
    async def over_http():
        client = http_stack.client()
        chat_r = await client.chat.completions.create(
            model=MODEL, messages=chat(CHAT_PROMPTS[0]), max_tokens=5, temperature=0, logprobs=True,
            top_logprobs=3, extra_body={"ignore_eos": True})
        completion_r = await client.completions.create(
            model=MODEL, prompt=COMPLETION_PROMPTS[0], max_tokens=5, temperature=0, logprobs=2,
            extra_body={"ignore_eos": True})
        return chat_r, completion_r

    chat_r, completion_r = run(over_http())
    content = chat_r.choices[0].logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == chat_r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
        assert t.bytes == list(t.token.encode())
    lp = completion_r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == completion_r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for top, token, value in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs):
        assert len(top) == 2 and top[token] == pytest.approx(value)


def test_stop_strings_max_completion_tokens_and_vllm_extras(http_stack):
    greedy = grpc_text(http_stack.stack.address, max_tokens=12, temperature=0.0,
                       messages=[gateway_pb2.ChatMessage(role="user", content=CHAT_PROMPTS[0])])[1]
    assert "Paris" in greedy

    async def over_http():
        client = http_stack.client()
        create = client.chat.completions.create
        base = dict(model=MODEL, messages=chat(CHAT_PROMPTS[0]))
        stopped = await create(max_tokens=12, temperature=0, stop=["Paris"], **base)
        capped = await create(max_completion_tokens=3, max_tokens=50, temperature=0, **base)
        top_k_1 = await create(max_tokens=12, temperature=1.0, extra_body={"top_k": 1}, **base)
        extras = await create(max_tokens=12, temperature=0, presence_penalty=0.5, frequency_penalty=0.5,
                              extra_body={"min_p": 0.1, "repetition_penalty": 1.3, "min_tokens": 12,
                                          "stop_token_ids": [2]}, **base)
        return stopped, capped, top_k_1, extras

    stopped, capped, top_k_1, extras = run(over_http())
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == greedy[:greedy.index("Paris")]
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"
    assert top_k_1.choices[0].message.content == greedy  # top_k=1 samples the greedy token
    # min_tokens holds EOS and stop token 2 back (greedy stops at EOS after "Paris.")
    assert extras.usage.completion_tokens == 12 and extras.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs,param", [
    ({"n": MAX_N + 1}, "n"),
    ({"n": 0}, "n"),
    ({"max_tokens": MAX_TOKENS_CAP + 1}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[0].type"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"extra_body": {"top_k": "many"}}, "top_k"),
    ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids[0]"),
    ({"seed": 2**64}, "seed"),
    ({"messages": [{"role": "user", "content": "hi"}] * 257}, "messages"),
], ids=["n over cap", "n zero", "max_tokens over cap", "no messages", "image part",
        "top_logprobs without logprobs", "top_k type", "negative stop token", "seed over int64",
        "messages over max_messages"])
def test_bad_input_is_400_naming_param_and_the_stack_keeps_serving(http_stack, kwargs, param):
    async def over_http():
        client = http_stack.client()
        args = {"model": MODEL, "messages": chat(CHAT_PROMPTS[0]), "max_tokens": 4, **kwargs}
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(**args)
        ok = await client.chat.completions.create(model=MODEL, messages=chat(CHAT_PROMPTS[0]),
                                                  max_tokens=2, temperature=0)
        return err.value, ok

    err, ok = run(over_http())
    assert err.status_code == 400
    assert err.body["param"] == param, err.body
    assert err.body["message"] and err.body["type"] == "invalid_request_error"
    assert ok.choices[0].finish_reason == "length"
