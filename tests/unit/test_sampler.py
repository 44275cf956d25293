"""Sampling: greedy, temperature, top-k/top-p masks, penalties, and draws that are a function of
(seed, output index) alone: independent of the batch, the worker and migration."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.input_batch import InputBatch
from services.engine.request import Request
from services.engine.sampler import apply_penalties, apply_top_k_top_p, sample, uniforms
from services.engine.sampling_params import SamplingParams

VOCAB = 1000


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def random_rows_path(request, monkeypatch):
    """Every test on both ways a CPU draws random rows: the C kernel (``kernels.sampling``)
    and the torch ops (what a GPU runs, and a CPU without a compiler)."""
    from kernels import sampling as cpu_sampling

    if request.param == "kernel" and not cpu_sampling.available():
        pytest.skip("no C compiler: the CPU sampling kernel is not built")
    if request.param == "torch":
        monkeypatch.setattr(cpu_sampling, "available", lambda: False)
    return request.param


def requests(params: list[SamplingParams], outputs: list[list[int]] | None = None,
             prompts: list[list[int]] | None = None) -> list[Request]:
    reqs = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", (prompts or [[1]] * len(params))[i], p, eos_token_id=0)
        r.output_token_ids = list((outputs or [[]] * len(params))[i])
        reqs.append(r)
    return reqs


def batch_for(reqs: list[Request], vocab: int = VOCAB):
    """An InputBatch holding ``reqs`` and the SamplingBatch of their rows, in order."""
    ib = InputBatch(max_model_len=256, block_size=4, vocab_size=vocab)
    rows = np.array([ib.add(r) for r in reqs], dtype=np.int64)
    return ib, rows, ib.sampling(rows)


def draw(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
    return sample(logits, batch_for(reqs, logits.shape[1])[2]).token_ids.tolist()


def test_greedy_is_argmax():
    logits = torch.randn(4, 100)
    assert draw(logits, requests([SamplingParams(temperature=0)] * 4)) == logits.argmax(-1).tolist()


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
    reqs = requests([SamplingParams(temperature=5.0, top_k=1, seed=i) for i in range(8)])
    assert draw(logits, reqs) == logits.argmax(-1).tolist()


def test_uniforms_are_a_function_of_seed_and_index_and_look_uniform():
    seeds = np.arange(200_000, dtype=np.uint64)
    u = uniforms(seeds, np.zeros(200_000, dtype=np.int64))
    assert np.array_equal(u, uniforms(seeds, np.zeros(200_000, dtype=np.int64)))
    assert u.min() >= 0 and u.max() < 1 and np.all(u * 2**24 == np.floor(u * 2**24))
    hist = np.histogram(u, bins=20, range=(0, 1))[0] / u.size
    assert np.abs(hist - 0.05).max() < 0.003, hist  # 200k draws: sd of a bin ~0.0005
    # neighbouring indices and neighbouring seeds are not correlated
    v = uniforms(seeds, np.ones(200_000, dtype=np.int64))
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.01 and abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01
    assert len(np.unique(u)) > 190_000


def test_seeded_request_samples_the_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    seeded = SamplingParams(seed=1234)
    alone = draw(logits[:1], requests([seeded]))
    mixed = draw(logits[[3, 0, 5]], requests([SamplingParams(), seeded, SamplingParams(temperature=0)]))
    assert mixed[1] == alone[0]
    # a stream of draws: the same seed gives the same sequence with or without neighbours
    for neighbours in ([], [SamplingParams(seed=8), SamplingParams(top_p=0.5)]):
        reqs = requests([SamplingParams(seed=7), *neighbours])
        ib, rows, _ = batch_for(reqs)
        stream = []
        for _ in range(20):
            got = sample(logits[:len(reqs)], ib.sampling(rows)).token_ids.tolist()
            ib.record_sampled(rows, got)  # the next draw is the next output index
            stream.append(got[0])
        if not neighbours:
            first = stream
    assert stream == first and len(set(stream)) > 1


def test_a_resumed_request_draws_what_the_uninterrupted_one_would():
    """Migration: the new attempt's prompt ends with the 5 tokens already generated."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    whole = requests([SamplingParams(seed=42)], outputs=[[11, 12, 13, 14, 15]], prompts=[[1, 2]])
    resumed = requests([SamplingParams(seed=42, num_prior_output_tokens=5)],
                       prompts=[[1, 2, 11, 12, 13, 14, 15]])
    assert draw(logits, whole) == draw(logits, resumed)
    assert draw(logits, whole) != draw(logits, requests([SamplingParams(seed=42)], prompts=[[1, 2]]))


def test_temperature_sampling_follows_the_softmax():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).expand(4000, 3).contiguous()
    got = draw(logits, requests([SamplingParams(temperature=1.0, seed=s) for s in range(4000)]))
    freqs = torch.bincount(torch.tensor(got), minlength=3).float() / 4000
    assert torch.allclose(freqs, probs, atol=0.03), freqs
    hot = draw(logits, requests([SamplingParams(temperature=0.25, seed=s) for s in range(4000)]))
    sharp = probs**4 / (probs**4).sum()
    assert torch.allclose(torch.bincount(torch.tensor(hot), minlength=3).float() / 4000, sharp,
                          atol=0.03)


def test_top_k_top_p_among_candidates_equals_a_full_sort():
    from services.engine import sampler

    gen = torch.Generator().manual_seed(5)
    flat = torch.randn(4, 4000, generator=gen) * 0.1  # nuclei far beyond the candidates
    peaky = torch.randn(4, 4000, generator=gen) * 8.0  # nuclei of a few tokens
    logits = torch.cat((flat, peaky))
    top_k = torch.tensor([0, 10, 600, 0, 0, 3, 0, 700])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.2, 0.95, 0.9, 0.5, 1.0])
    got = apply_top_k_top_p(logits, top_k, top_p)
    want = sampler._cut(logits, *logits.sort(dim=-1, descending=True), top_k, top_p, None)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])
    kept = torch.isfinite(got).sum(-1)
    assert kept[1] == 10 and kept[5] == 3 and kept[7] == 700 and (kept[4:7] < sampler.CANDIDATES).all()


def test_a_draw_never_lands_on_a_masked_token():
    # top-k 2 of 5: tokens 2-4 have probability 0; the largest uniforms still pick token 0 or 1
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).expand(3000, 5).contiguous()
    got = draw(logits, requests([SamplingParams(top_k=2, seed=s) for s in range(3000)]))
    assert set(got) == {0, 1}


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.01), ("max_tokens", 0), ("top_k", -1),
    ("seed", -1), ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("logprobs", 21), ("min_tokens", -1), ("stop", ("",)),
    ("num_prior_output_tokens", -1),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_is_checked_against_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0]] * 3)
    reqs = requests(
        [SamplingParams(temperature=0, frequency_penalty=0.5), SamplingParams(temperature=0, presence_penalty=1.5),
         SamplingParams(temperature=0, repetition_penalty=2.0)],
        [[0, 0, 0], [0, 3], [2]], prompts=[[4], [4], [0]])
    p = batch_for(reqs, 5)[2].penalties
    assert p.rows.tolist() == [0, 1, 2]
    out = apply_penalties(logits, p.presence, p.frequency, p.repetition, p.history, p.output_from)
    assert out[0].tolist() == [2.0 - 1.5, 1.0, -1.0, 0.5, 0.0]  # 3 occurrences x 0.5
    assert out[1].tolist() == [2.0 - 1.5, 1.0, -1.0, 0.5 - 1.5, 0.0]  # once per seen token
    assert out[2].tolist() == [1.0, 1.0, -2.0, 0.5, 0.0]  # prompt token 0 and output token 2
    assert draw(logits, reqs) == [1, 1, 0]


def test_penalties_count_a_resumed_request_s_earlier_output():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0]])
    whole = requests([SamplingParams(temperature=0, frequency_penalty=0.5)], [[0, 0, 0]], [[4]])
    resumed = requests([SamplingParams(temperature=0, frequency_penalty=0.5,
                                       num_prior_output_tokens=3)], prompts=[[4, 0, 0, 0]])
    for reqs in (whole, resumed):
        p = batch_for(reqs, 5)[2].penalties
        out = apply_penalties(logits, p.presence, p.frequency, p.repetition, p.history, p.output_from)
        assert out[0].tolist() == [2.0 - 1.5, 1.0, -1.0, 0.5, 0.0]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]] * 3)  # EOS (0) is the argmax
    reqs = requests([SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(1,), max_tokens=5),
                     SamplingParams(temperature=0, min_tokens=2, max_tokens=5),
                     SamplingParams(temperature=0, min_tokens=2, max_tokens=5)], [[3], [3, 3], [3]])
    assert draw(logits, reqs) == [2, 0, 1]


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(300, 4).contiguous()
    got = draw(logits, requests([SamplingParams(temperature=1.0, min_p=0.5, seed=s) for s in range(300)]))
    assert set(got) == {0, 1}  # 0.15 < 0.5 x 0.5


def test_logprobs_of_the_raw_distribution_in_one_host_copy():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    reqs = requests([SamplingParams(temperature=0, logprobs=2, repetition_penalty=3.0),
                     SamplingParams(temperature=0)], [[0], []], prompts=[[3], [3]])
    out = sample(logits, batch_for(reqs, 4)[2])
    lp = torch.log_softmax(logits, -1)
    assert out.token_ids.tolist() == [1, 2]  # the penalty moved row 0's choice ...
    assert out.logprobs.tolist() == [lp[0, 1].item()]  # ... logprobs stay the model's; row 0 only
    assert out.top_ids.tolist() == [[0, 1]] and torch.equal(out.top_logprobs[0], lp[0, :2])
    ids, host_ids, host_lps = out.to_host()
    assert ids == [1, 2] and host_ids.tolist() == [[0, 1]]
    assert host_lps.dtype == np.float32 and host_lps.tolist() == [[lp[0, 1].item(), *lp[0, :2].tolist()]]


def test_a_stop_token_outside_the_vocabulary_raises_index_error_when_scheduled():
    from services.engine.scheduler import SchedulerOutput

    ib = InputBatch(max_model_len=64, block_size=4, vocab_size=100)
    r = Request("bad", [1, 2], SamplingParams(temperature=0, stop_token_ids=(100,)))
    r.block_table = [0]
    with pytest.raises(IndexError, match="stop_token_ids"):
        ib.prepare(SchedulerOutput([r], {"bad": 2}))


def test_plain_greedy_is_only_the_unmasked_argmax():
    base = SamplingParams(temperature=0)
    assert batch_for(requests([base]))[0].plain_greedy(np.array([0]))
    for params in (SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.7),
                   SamplingParams(temperature=0, presence_penalty=0.5),
                   SamplingParams(temperature=0, min_tokens=100, max_tokens=200),
                   SamplingParams(temperature=0, logit_bias=((5, 1.0),))):
        ib, rows, _ = batch_for(requests([base, params]))
        assert ib.plain_greedy(rows[:1]) and not ib.plain_greedy(rows), params


def test_rows_sample_alone_without_penalties_or_logprobs():
    """Async scheduling's test (``InputBatch.samples_alone``): greedy, random and biased rows
    sample from their logits and settings alone; penalties and logprobs read more."""
    alone = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, seed=1),
             SamplingParams(temperature=0, logit_bias=((5, 1.0),), min_tokens=3, max_tokens=9)]
    ib, rows, _ = batch_for(requests(alone))
    assert ib.samples_alone(rows)
    for params in (SamplingParams(temperature=0, logprobs=2),
                   SamplingParams(temperature=0.7, frequency_penalty=0.5)):
        ib, rows, _ = batch_for(requests([*alone, params]))
        assert ib.samples_alone(rows[:3]) and not ib.samples_alone(rows), params
