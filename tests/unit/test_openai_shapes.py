"""OpenAI HTTP shapes with no network: the choices of ``n`` (ids, seeds), usage over choices,
chunks per choice, logprob shapes, request-body checks naming the field; and the prefix-cache
hits a request records when first admitted (``num_cached_tokens``, reported as cached_tokens)."""
from __future__ import annotations

import pydantic
import pytest

from services.api import gateway_pb2
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.gateway.choices import child_requests
from services.gateway.openai_api import ChatCompletionRequest, CompletionRequest
from services.gateway.openai_responses import Chunker, usage
from services.gateway.pipeline import Prepared
from tests.unit.test_scheduler import EOS, SYSTEM, create_scheduler, step


def final(completion: int, prompt: int = 10, cached: int = 0, text: str = "x") -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(text=text, finish_reason="length", usage=gateway_pb2.Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        cached_tokens=cached))


def test_choices_get_their_own_ids_and_consecutive_seeds():
    p = Prepared("req", [1, 2, 3], SamplingParams(seed=41, temperature=1.0))
    children = child_requests([p], 3)
    assert [c.request_id for c in children] == ["req-0", "req-1", "req-2"]
    assert [c.params.seed for c in children] == [41, 42, 43]
    assert all(c.prompt == [1, 2, 3] and c.params.temperature == 1.0 for c in children)
    assert child_requests([p], 1) == [p]  # n = 1: the request itself, its id unchanged
    unseeded = child_requests([Prepared("u", [1], SamplingParams())], 2)
    assert [c.params.seed for c in unseeded] == [None, None]
    wrapped = child_requests([Prepared("w", [1], SamplingParams(seed=2**63 - 1))], 2)
    assert [c.params.seed for c in wrapped] == [2**63 - 1, 0]


def test_a_batch_orders_choices_by_prompt_then_choice_as_openai_does():
    a = Prepared("req", [1, 2], SamplingParams(seed=7, temperature=1.0))
    b = Prepared("req", [3], SamplingParams(seed=7, temperature=1.0))
    children = child_requests([a, b], 2)
    assert [c.request_id for c in children] == ["req-0", "req-1", "req-2", "req-3"]
    assert [c.prompt for c in children] == [[1, 2], [1, 2], [3], [3]]  # index = prompt * n + j
    assert [c.params.seed for c in children] == [7, 8, 7, 8]  # choice j: seed + j, per prompt
    assert [c.request_id for c in child_requests([a, b], 1)] == ["req-0", "req-1"]


def test_usage_counts_the_prompt_once_and_sums_completions():
    u = usage({0: final(5, cached=8), 1: final(7, cached=0), 2: final(3, cached=8)}, n=3)
    assert u == {"prompt_tokens": 10, "completion_tokens": 15, "total_tokens": 25,
                 "prompt_tokens_details": {"cached_tokens": 8}}
    assert usage({}, n=1) is None
    # a batch of two prompts, n = 2: each prompt counted once (by its first choice)
    batch = usage({0: final(5, prompt=10, cached=8), 1: final(7, prompt=10, cached=8),
                   2: final(3, prompt=4), 3: final(1, prompt=4)}, n=2)
    assert batch == {"prompt_tokens": 14, "completion_tokens": 16, "total_tokens": 30,
                     "prompt_tokens_details": {"cached_tokens": 8}}


def test_chat_chunks_carry_their_choice_and_each_choice_starts_with_the_role():
    c = Chunker("chat", "r", "m", n=2)
    first0 = c.chunk(0, gateway_pb2.GenerateResponse(text="a"))
    first1 = c.chunk(1, gateway_pb2.GenerateResponse(text="b"))
    later0 = c.chunk(0, final(2, text="c"))
    assert [x["choices"][0]["index"] for x in (first0, first1, later0)] == [0, 1, 0]
    assert first0["choices"][0]["delta"] == {"content": "a", "role": "assistant"}
    assert first1["choices"][0]["delta"] == {"content": "b", "role": "assistant"}
    assert later0["choices"][0]["delta"] == {"content": "c"} and "usage" not in later0
    c.chunk(1, final(4, text="d"))
    last = c.usage_chunk()
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert {x["id"] for x in (first0, first1, later0, last)} == {"chatcmpl-r"}


def logprob(text: str, value: float) -> gateway_pb2.TokenLogprob:
    return gateway_pb2.TokenLogprob(text=text, logprob=value, top_logprobs=[
        gateway_pb2.TopLogprob(text=text, logprob=value), gateway_pb2.TopLogprob(text="?", logprob=-9.0)])


def test_completion_logprobs_offsets_run_on_across_chunks_and_choices_stay_apart():
    c = Chunker("completion", "r", "m", n=2)
    a = c.chunk(0, gateway_pb2.GenerateResponse(text="Hello", logprobs=[logprob("Hel", -0.1), logprob("lo", -0.2)]))
    b = c.chunk(0, gateway_pb2.GenerateResponse(text=" you", logprobs=[logprob(" you", -0.3)]))
    other = c.chunk(1, gateway_pb2.GenerateResponse(text="Hi", logprobs=[logprob("Hi", -0.4)]))
    assert a["choices"][0]["logprobs"]["text_offset"] == [0, 3]
    assert b["choices"][0]["logprobs"]["text_offset"] == [5]
    assert other["choices"][0]["logprobs"]["text_offset"] == [0]
    assert a["choices"][0]["logprobs"]["top_logprobs"][0] == {"Hel": pytest.approx(-0.1), "?": -9.0}


def test_whole_response_lists_every_choice_in_index_order():
    c = Chunker("chat", "r", "m", n=2)
    body = c.whole([[gateway_pb2.GenerateResponse(text="a"), final(2, text="b")], [final(1, text="z")]])
    assert [(x["index"], x["message"]["content"]) for x in body["choices"]] == [(0, "ab"), (1, "z")]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "ab", "refusal": None}
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("body,field", [
    ({"n": 0}, "n"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"top_k": 2**40}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": [2**32]}, "stop_token_ids"),
])
def test_out_of_range_numbers_fail_validation_naming_the_field(body, field):
    with pytest.raises(pydantic.ValidationError) as err:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
    assert err.value.errors()[0]["loc"][0] == field


def test_n_over_the_limit_names_n_and_content_parts_are_joined():
    req = ChatCompletionRequest.model_validate({"n": 5, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "you"}]}]})
    with pytest.raises(ValueError, match=r"^n: 5 choices exceed .* limit of 4 choices per request \(setting max_n\)"):
        req.check_n(4)
    assert req.to_protos("r")[0].messages[0].content == "Hello, you"
    assert CompletionRequest.model_validate({"prompt": "x", "logprobs": 3}).to_protos("r")[0].top_logprobs == 3


def test_a_request_records_its_prefix_cache_hits_when_first_admitted():
    s = create_scheduler()  # block size 4; SYSTEM is 3 full blocks
    sp = SamplingParams(temperature=0, max_tokens=2)
    a = Request("a", SYSTEM + [1, 2], sp, eos_token_id=EOS)
    s.add_request(a)
    step(s)
    assert a.num_cached_tokens == 0
    b = Request("b", SYSTEM + [3], sp, eos_token_id=EOS)
    s.add_request(b)
    step(s)
    assert b.num_cached_tokens == 12
