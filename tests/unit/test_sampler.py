"""Sampling: greedy, temperature, top-k/top-p masks, per-request seeds independent of the batch."""
from __future__ import annotations

import pytest
import torch

from services.engine.request import Request
from services.engine.sampler import SamplingMetadata, apply_top_k_top_p, make_generator, sample
from services.engine.sampling_params import SamplingParams


def meta_for(params: list[SamplingParams], seed_offset: int = 0) -> SamplingMetadata:
    reqs = [Request(f"r{i}", [1], p) for i, p in enumerate(params)]
    gens = {r.request_id: make_generator(r.sampling_params.seed) for r in reqs}
    return SamplingMetadata.from_requests(reqs, gens)


def test_greedy_is_argmax():
    logits = torch.randn(4, 100)
    ids = sample(logits, meta_for([SamplingParams(temperature=0)] * 4)).token_ids
    assert torch.equal(ids, logits.argmax(-1))


def test_top_k_and_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    masked = apply_top_k_top_p(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.7, 0.01]))
    kept = torch.isfinite(masked)
    assert kept[0].tolist() == [True, True, False, False, False]  # top-2
    assert kept[1].tolist() == [True, True, False, False, False]  # 0.5 + 0.2 reaches 0.7
    assert kept[2].tolist() == [True, False, False, False, False]  # at least one survives
    assert torch.equal(masked[kept], logits[kept])


def test_top_k_one_is_greedy_even_at_high_temperature():
    logits = torch.randn(8, 50)
    ids = sample(logits, meta_for([SamplingParams(temperature=5.0, top_k=1, seed=i) for i in range(8)])).token_ids
    assert torch.equal(ids, logits.argmax(-1))


def test_seeded_request_samples_the_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    alone = [sample(logits[:1], meta_for([SamplingParams(seed=1234)])).token_ids.item()]
    mixed = sample(logits[[0, 3, 5]], meta_for([SamplingParams(seed=1234), SamplingParams(),
                                                 SamplingParams(temperature=0)])).token_ids
    assert mixed[0].item() == alone[0]
    # a stream of draws: same seed, same sequence, with or without neighbours
    m1, m2 = meta_for([SamplingParams(seed=7)]), meta_for([SamplingParams(seed=7), SamplingParams(seed=8)])
    seq1 = [sample(logits[:1], m1).token_ids.item() for _ in range(20)]
    seq2 = [sample(logits[[0, 1]], m2).token_ids[0].item() for _ in range(20)]
    assert seq1 == seq2 and len(set(seq1)) > 1


def test_temperature_sampling_follows_the_softmax():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    meta = meta_for([SamplingParams(temperature=1.0, seed=0)])
    counts = torch.bincount(torch.stack([sample(logits, meta).token_ids for _ in range(4000)]).flatten(), minlength=3)
    freqs = counts.float() / counts.sum()
    assert torch.allclose(freqs, torch.tensor([0.6, 0.3, 0.1]), atol=0.03), freqs


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.01), ("max_tokens", 0), ("top_k", -1),
    ("seed", -1), ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("logprobs", 21), ("min_tokens", -1), ("stop", ("",)),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_is_checked_against_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def reqs_with(params: list[SamplingParams], outputs: list[list[int]], prompts=None) -> list[Request]:
    reqs = []
    for i, (p, out) in enumerate(zip(params, outputs)):
        r = Request(f"r{i}", (prompts or [[1]] * len(params))[i], p, eos_token_id=0)
        r.output_token_ids = list(out)
        reqs.append(r)
    return reqs


def run(logits, reqs):
    gens = {r.request_id: make_generator(r.sampling_params.seed) for r in reqs}
    return sample(logits, SamplingMetadata.from_requests(reqs, gens))


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0]] * 3)
    reqs = reqs_with(
        [SamplingParams(temperature=0, frequency_penalty=0.5), SamplingParams(temperature=0, presence_penalty=1.5),
         SamplingParams(temperature=0, repetition_penalty=2.0)],
        [[0, 0, 0], [0, 3], [2]], prompts=[[4], [4], [0]])
    meta = SamplingMetadata.from_requests(reqs, {})
    from services.engine.sampler import apply_penalties
    out = apply_penalties(logits, **meta.penalties)
    assert out[0].tolist() == [2.0 - 1.5, 1.0, -1.0, 0.5, 0.0]  # 3 occurrences x 0.5
    assert out[1].tolist() == [2.0 - 1.5, 1.0, -1.0, 0.5 - 1.5, 0.0]  # once per seen token
    assert out[2].tolist() == [1.0, 1.0, -2.0, 0.5, 0.0]  # prompt token 0 and output token 2
    assert run(logits, reqs).token_ids.tolist() == [1, 1, 0]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]] * 3)  # EOS (0) is the argmax
    reqs = reqs_with([SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(1,), max_tokens=5),
                      SamplingParams(temperature=0, min_tokens=2, max_tokens=5),
                      SamplingParams(temperature=0, min_tokens=2, max_tokens=5)], [[3], [3, 3], [3]])
    assert run(logits, reqs).token_ids.tolist() == [2, 0, 1]


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    reqs = reqs_with([SamplingParams(temperature=1.0, min_p=0.5, seed=3)], [[]])
    gens = {"r0": make_generator(3)}
    meta = SamplingMetadata.from_requests(reqs, gens)
    seen = {sample(logits, meta).token_ids.item() for _ in range(300)}
    assert seen == {0, 1}  # 0.15 < 0.5 x 0.5


def test_logprobs_of_the_raw_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    reqs = reqs_with([SamplingParams(temperature=0, logprobs=2, repetition_penalty=3.0)], [[0]], prompts=[[3]])
    out = run(logits, reqs)
    lp = torch.log_softmax(logits, -1)[0]
    assert out.token_ids.tolist() == [1]  # penalty moved the choice ...
    assert out.logprobs.tolist() == [lp[1].item()]  # ... logprobs stay those of the model
    assert out.top_ids.tolist() == [[0, 1]] and torch.allclose(out.top_logprobs[0], lp[:2])
