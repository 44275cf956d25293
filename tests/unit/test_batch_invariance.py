"""Same input, same output, in the engine: in the default precision (the built-in GGUF's Q4_1
weights, int8 activations, the fused C forward) a greedy request's token ids and logprobs are
the same bits alone on a cold cache, with its prefix cached, inside a batch of 16 others, with
its prompt chunked by 7 tokens, after a preemption (recomputed), on 1 or 2 threads, and when
another engine continues it from its prompt and the tokens so far (what a migration does).

The kernels' own row-invariance tests are tests/kernels/test_batch_invariance.py; the same
request through the whole stack is tests/integration/test_determinism.py.
"""
from __future__ import annotations

import random

import pytest
import torch

from kernels import cpu_attention, decode_ops, quant
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not (quant.available() and decode_ops.available() and cpu_attention.available()),
    reason="the C kernels are not built (no compiler)")

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
_rng = random.Random(28)
# 45 tokens: two full 16-token blocks (a cacheable prefix) and 13 more
PROMPT = [_rng.randrange(17, 49152) for _ in range(45)]
OTHERS = [[_rng.randrange(17, 49152) for _ in range(_rng.randrange(5, 70))] for _ in range(16)]


def engine(**overrides) -> LLMEngine:
    e = LLMEngine(EngineConfig(dtype="auto", quantization="auto", **{"num_kv_blocks": 512,
                                                                      **overrides}))
    assert e.precision.quantization == "q4_1" and e.runner.model.fused_forward is not None
    assert e.kv_cache.dtype == torch.float16  # auto: the served default's float16 KV cache
    e.warm_up()
    return e


def run(e: LLMEngine, prompts: list[list[int]], tag: str,
        params: SamplingParams = GREEDY) -> list[tuple[list[int], list]]:
    """(token ids, per token (logprob, top 5)) of each prompt, all submitted at once (other
    requests already in the engine run beside them)."""
    for i, p in enumerate(prompts):
        e.add_request(e.make_request(f"{tag}-{i}", p, params))
    got: dict[str, tuple[list[int], list]] = {f"{tag}-{i}": ([], []) for i in range(len(prompts))}
    while e.has_work():
        for o in e.step():
            assert o.error is None
            if o.request_id in got:
                got[o.request_id][0].extend(o.new_token_ids)
                got[o.request_id][1].extend((lp.logprob, lp.top) for lp in o.logprobs)
    return [got[f"{tag}-{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def alone() -> tuple[list[int], list]:
    """The request alone on a fresh engine (cold cache), 2 threads."""
    out = run(engine(), [PROMPT], "alone")[0]
    assert len(out[0]) == MAX_TOKENS and len(out[1]) == MAX_TOKENS
    return out


def test_prefix_cached(alone):
    e = engine()
    assert run(e, [PROMPT[:40] + [7, 8, 9]], "warm")  # caches the prompt's first 2 blocks
    hits = e.scheduler.prefix_cache_hits
    assert run(e, [PROMPT], "cached")[0] == alone
    assert e.scheduler.prefix_cache_hits - hits == 32


def test_inside_a_batch_of_16_others(alone):
    """Among 16 other prompts of 5-69 tokens, submitted together: prefill chunks and decode
    steps of 17 rows, then fewer as the others finish (their lengths differ)."""
    others = [SamplingParams(temperature=0, max_tokens=8 + i, ignore_eos=True) for i in range(16)]
    e = engine()
    for i, (p, params) in enumerate(zip(OTHERS, others)):
        e.add_request(e.make_request(f"other-{i}", p, params))
    assert run(e, [PROMPT], "batched")[0] == alone


def test_prompt_chunked_by_7_tokens(alone):
    """A 7-token step budget: the prompt in 7 chunks (the last of 3), then decode."""
    assert run(engine(max_num_batched_tokens=7), [PROMPT], "chunked")[0] == alone


def test_after_preemption(alone):
    """24 KV blocks for 8 requests: the newest running ones are preempted (their KV freed)
    and recomputed later, prompt and output tokens as one prefill."""
    e = engine(num_kv_blocks=24, max_num_seqs=8)
    outs = run(e, [PROMPT] + OTHERS[:7], "preempted")
    assert e.scheduler.num_preemptions > 0
    assert outs[0] == alone


def test_one_thread_or_two(alone):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run(engine(), [PROMPT], "one-thread")[0] == alone
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("done", [1, 9])
def test_continued_elsewhere_from_the_tokens_so_far(alone, done):
    """A migration: another engine gets the prompt and the first ``done`` output tokens as its
    prompt (the gateway's re-dispatch) and generates the rest: the same tokens and logprobs as
    the uninterrupted run."""
    tokens, logprobs = alone
    params = GREEDY.model_copy(update={"max_tokens": MAX_TOKENS - done})
    rest = run(engine(), [PROMPT + tokens[:done]], "migrated", params)[0]
    assert rest == (tokens[done:], logprobs[done:])


def test_logprobs_do_not_depend_on_who_asked_for_them(alone):
    """A batch mixing requests with and without logprobs: the greedy argmax path and the
    sampler's logprob path see the same logits."""
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    e = engine()
    for i, p in enumerate(OTHERS[:3]):
        e.add_request(e.make_request(f"plain-{i}", p, plain))
    assert run(e, [PROMPT], "mixed")[0] == alone
