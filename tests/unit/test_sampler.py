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
    ids = sample(logits, meta_for([SamplingParams(temperature=0)] * 4))
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
    ids = sample(logits, meta_for([SamplingParams(temperature=5.0, top_k=1, seed=i) for i in range(8)]))
    assert torch.equal(ids, logits.argmax(-1))


def test_seeded_request_samples_the_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    alone = [sample(logits[:1], meta_for([SamplingParams(seed=1234)])).item() for _ in range(1)]
    mixed = sample(logits[[0, 3, 5]], meta_for([SamplingParams(seed=1234), SamplingParams(),
                                                 SamplingParams(temperature=0)]))
    assert mixed[0].item() == alone[0]
    # a stream of draws: same seed, same sequence, with or without neighbours
    m1, m2 = meta_for([SamplingParams(seed=7)]), meta_for([SamplingParams(seed=7), SamplingParams(seed=8)])
    seq1 = [sample(logits[:1], m1).item() for _ in range(20)]
    seq2 = [sample(logits[[0, 1]], m2)[0].item() for _ in range(20)]
    assert seq1 == seq2 and len(set(seq1)) > 1


def test_temperature_sampling_follows_the_softmax():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    meta = meta_for([SamplingParams(temperature=1.0, seed=0)])
    counts = torch.bincount(torch.stack([sample(logits, meta) for _ in range(4000)]).flatten(), minlength=3)
    freqs = counts.float() / counts.sum()
    assert torch.allclose(freqs, torch.tensor([0.6, 0.3, 0.1]), atol=0.03), freqs


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.01),
                                         ("max_tokens", 0), ("top_k", -1), ("seed", -1)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
