"""The CPU sampling kernel (``kernels.sampling``): every draw against the definition computed
in float64 over a full sort of the row, the distribution it draws, independence of the batch,
the thread count and the build's instruction set, and its errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import native, sampling
from kernels.cpu_attention import CFLAGS, LDFLAGS

pytestmark = pytest.mark.skipif(not sampling.available(), reason="no C compiler")

BUILT_IN_VOCAB = 49_152


def settings(n: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, u=None):
    full = lambda v, dtype=torch.float32: torch.full((n,), v, dtype=dtype)  # noqa: E731
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(n)) if u is None else u
    return (full(temperature), full(top_k, torch.int64), full(top_p), full(min_p),
            uniforms.to(torch.float32))


def draw(logits, rows=None, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, u=None):
    rows = torch.arange(logits.shape[0]) if rows is None else torch.as_tensor(rows)
    t, k, p, mp, uu = settings(rows.shape[0], temperature, top_k, top_p, min_p, u)
    return sampling.sample_rows(logits, rows, t, k, p, mp, uu)


def reference_token(row: np.ndarray, u: float, temperature, top_k, top_p, min_p):
    """(token, how far u * total lies from the nearest edge of the cumulative sum, relative)."""
    kept, w = sampling.survivors_reference(row, temperature, top_k, top_p, min_p)
    c = np.cumsum(w)
    target = u * c[-1]
    i = int(np.searchsorted(c, target, side="right"))
    edges = np.concatenate(([0.0], c))
    return int(kept[min(i, len(kept) - 1)]), float(np.abs(edges - target).min() / c[-1])


def logits_like_a_model(n: int, vocab: int, seed: int) -> torch.Tensor:
    """Peaky rows (a few tokens far ahead, as a language model's) and flat ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 2.0
    heads = torch.randint(0, vocab, (n, 8), generator=g)
    x.scatter_add_(1, heads, torch.rand(n, 8, generator=g) * 12.0)
    x[1::4] *= 0.05  # flat rows: nuclei of thousands of tokens
    return x


CASES = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.0, 0, 0.95, 0.0), (0.8, 40, 0.95, 0.05),
    (1.0, 50, 1.0, 0.0), (1.5, 0, 0.99, 0.0), (0.3, 3, 0.5, 0.0), (2.0, 1000, 0.8, 0.01),
    (1.0, 0, 1.0, 0.2),
]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", CASES)
def test_every_draw_is_the_definitions_token(temperature, top_k, top_p, min_p):
    logits = logits_like_a_model(24, BUILT_IN_VOCAB, seed=int(temperature * 100) + top_k)
    u = torch.rand(24, generator=torch.Generator().manual_seed(top_k))
    got = draw(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, u=u)
    for j in range(24):
        want, margin = reference_token(logits[j].numpy(), float(u[j]), temperature, top_k,
                                       top_p, min_p)
        # float32 weights against float64 ones: only a draw within rounding of an edge may differ
        assert got[j].item() == want or margin < 1e-5, (j, got[j].item(), want, margin)


def test_the_draws_follow_the_filtered_distribution_exactly():
    """A grid of uniforms through the inverse transform: each survivor is drawn for its share of
    the grid, to one grid step; no other token is drawn."""
    vocab, grid = 500, 20_000
    logits = logits_like_a_model(1, vocab, seed=3)
    for temperature, top_k, top_p, min_p in CASES:
        u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
        got = draw(logits.expand(grid, vocab).contiguous(), temperature=temperature, top_k=top_k,
                   top_p=top_p, min_p=min_p, u=u.float())
        kept, w = sampling.survivors_reference(logits[0].numpy(), temperature, top_k, top_p, min_p)
        counts = np.bincount(got.numpy(), minlength=vocab)
        assert set(np.flatnonzero(counts)) <= set(kept.tolist())
        assert np.abs(counts[kept] - grid * w / w.sum()).max() <= 1.5


def test_top_k_one_and_a_tiny_top_p_take_the_argmax():
    logits = logits_like_a_model(16, 3000, seed=4)
    argmax = logits.argmax(-1)
    assert torch.equal(draw(logits, temperature=3.0, top_k=1), argmax)
    assert torch.equal(draw(logits, temperature=3.0, top_p=1e-6), argmax)
    assert torch.equal(draw(logits, temperature=3.0, min_p=1.0), argmax)


def test_masked_and_nan_logits_are_never_drawn():
    logits = torch.zeros(2000, 37)
    logits[:, ::2] = float("-inf")
    logits[:, 1::4] = float("nan")  # odd ids 1, 5, 9, ...: NaN; 3, 7, 11, ...: finite
    got = draw(logits, temperature=1.0, u=torch.linspace(0, 1 - 2**-24, 2000))
    assert set(got.tolist()) == set(range(3, 37, 4))
    only = torch.full((3, 40), float("-inf"))
    only[:, 17] = -5.0
    assert draw(only, top_p=0.5, top_k=3).tolist() == [17, 17, 17]


def test_a_row_draws_the_same_alone_in_any_batch_and_on_any_thread_count():
    logits = logits_like_a_model(12, BUILT_IN_VOCAB, seed=5)
    t = torch.tensor([0.7, 1.0, 1.5, 0.8] * 3)
    k = torch.tensor([0, 50, 0, 40] * 3)
    p = torch.tensor([0.9, 1.0, 0.99, 0.95] * 3)
    mp = torch.tensor([0.0, 0.0, 0.0, 0.05] * 3)
    u = torch.rand(12, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = sampling.sample_rows(logits, torch.arange(12), t, k, p, mp, u)
        torch.set_num_threads(1)
        single = sampling.sample_rows(logits, torch.arange(12), t, k, p, mp, u)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, single)
    for j in (0, 5, 11):  # alone, its logits the only row, settings from the batch
        one = sampling.sample_rows(logits[j:j + 1].clone(), torch.tensor([0]), t[j:j + 1],
                                   k[j:j + 1], p[j:j + 1], mp[j:j + 1], u[j:j + 1])
        assert one.item() == batch[j].item()
    # rows picked out of a larger logits tensor, in another order
    picked = sampling.sample_rows(logits, torch.tensor([11, 0, 5]), t[[11, 0, 5]], k[[11, 0, 5]],
                                  p[[11, 0, 5]], mp[[11, 0, 5]], u[[11, 0, 5]])
    assert picked.tolist() == batch[[11, 0, 5]].tolist()


def test_vocabularies_off_the_vector_width_and_of_one_token():
    for vocab in (1, 15, 17, 33, 1001):
        logits = logits_like_a_model(8, vocab, seed=vocab)
        u = torch.rand(8, generator=torch.Generator().manual_seed(vocab))
        got = draw(logits, temperature=0.9, top_p=0.9, top_k=5, u=u)
        for j in range(8):
            want, margin = reference_token(logits[j].numpy(), float(u[j]), 0.9, 5, 0.9, 0.0)
            assert got[j].item() == want or margin < 1e-5


def test_the_portable_build_draws_what_the_vector_build_does(tmp_path, monkeypatch):
    """x86-64 without AVX-512 (the scalar loops) against this machine's build: the same exp and
    the same sums, so the same tokens."""
    if "-march=native" not in CFLAGS or native.families()[0].name != "x86_64":
        pytest.skip("x86-64 builds only")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    flags = tuple(f if not f.startswith("-march=") else "-march=x86-64" for f in CFLAGS)
    compiler = native._compiler(None)  # given, so nothing prebuilt is taken instead
    portable = sampling.load(native.shared_library(sampling.SOURCE, flags, LDFLAGS, compiler))
    logits = logits_like_a_model(16, 4099, seed=8)
    u = torch.rand(16, generator=torch.Generator().manual_seed(8))
    vector = [draw(logits, temperature=t, top_k=k, top_p=p, min_p=mp, u=u) for t, k, p, mp in CASES]
    monkeypatch.setattr(sampling, "lib", lambda: portable)
    for (t, k, p, mp), want in zip(CASES, vector):
        assert torch.equal(draw(logits, temperature=t, top_k=k, top_p=p, min_p=mp, u=u), want)


@pytest.mark.parametrize("field, value, message", [
    ("temperature", 0.0, "setting out of range"), ("top_p", 0.0, "setting out of range"),
    ("top_p", 1.5, "setting out of range"), ("min_p", -0.1, "setting out of range"),
    ("top_k", -1, "setting out of range"), ("uniforms", 1.0, "setting out of range"),
])
def test_a_setting_out_of_range_is_refused_before_anything_is_drawn(field, value, message):
    logits = torch.randn(2, 50)
    t, k, p, mp, u = settings(2)
    given = dict(temperature=t, top_k=k, top_p=p, min_p=mp, uniforms=u)
    given[field] = given[field].clone()
    given[field][1] = value
    with pytest.raises(ValueError, match=message):
        sampling.sample_rows(logits, torch.arange(2), **given)


def test_bad_rows_dtypes_and_shapes_are_refused():
    logits = torch.randn(2, 50)
    t, k, p, mp, u = settings(1)
    with pytest.raises(ValueError, match="row outside the logits"):
        sampling.sample_rows(logits, torch.tensor([2]), t, k, p, mp, u)
    with pytest.raises(ValueError, match="float32 expected"):
        sampling.sample_rows(logits.double(), torch.tensor([0]), t, k, p, mp, u)
    with pytest.raises(ValueError, match=r"every setting \[2\] like rows"):
        sampling.sample_rows(logits, torch.tensor([0, 1]), t, k, p, mp, u)


def test_logprobs_are_log_softmax_s_and_the_top_ids_topk_s():
    logits = logits_like_a_model(10, BUILT_IN_VOCAB, seed=9)
    rows = torch.tensor([3, 0, 9, 3])
    chosen = torch.tensor([5, 17, 49_151, 5])
    lp, top_ids, top_lp = sampling.logprobs_rows(logits, rows, chosen, 20)
    want = torch.log_softmax(logits[rows].double(), -1)
    assert torch.allclose(lp.double(), want.gather(1, chosen[:, None])[:, 0], atol=2e-5, rtol=0)
    want_lp, want_ids = want.topk(20, -1)
    assert torch.equal(top_ids, want_ids)
    assert torch.allclose(top_lp.double(), want_lp, atol=2e-5, rtol=0)
    # a row's values depend on it alone: the same row twice, or alone, gives the same bits
    assert torch.equal(lp[0], lp[3]) and torch.equal(top_lp[0], top_lp[3])
    alone = sampling.logprobs_rows(logits[3:4].clone(), torch.tensor([0]), chosen[:1], 20)
    assert torch.equal(alone[0], lp[:1]) and torch.equal(alone[2], top_lp[:1])
    none = sampling.logprobs_rows(logits, rows, chosen, 0)
    assert none[1].shape == (4, 0) and torch.equal(none[0], lp)


def test_logprob_ties_go_to_the_lower_id_and_masked_tokens_come_last():
    logits = torch.full((1, 40), float("-inf"))
    logits[0, [30, 4, 22]] = torch.tensor([1.0, 2.0, 1.0])
    lp, ids, top = sampling.logprobs_rows(logits, torch.tensor([0]), torch.tensor([0]), 5)
    assert ids[0].tolist() == [4, 22, 30, 0, 1]
    assert lp.item() == float("-inf") and top[0, 3:].tolist() == [float("-inf")] * 2
    assert torch.allclose(top[0, :3].exp().sum(), torch.tensor(1.0))


def test_logprobs_refuse_tokens_and_top_counts_out_of_range():
    logits = torch.randn(2, 50)
    with pytest.raises(ValueError, match="token outside the vocabulary"):
        sampling.logprobs_rows(logits, torch.tensor([0]), torch.tensor([50]), 1)
    with pytest.raises(ValueError, match="num_top 0 to vocabulary"):
        sampling.logprobs_rows(logits, torch.tensor([0]), torch.tensor([1]), 51)
