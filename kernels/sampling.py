"""Random sampling of logits rows on a CPU (``csrc/sampling.c``, OpenMP): temperature, min-p,
top-k and top-p, then one inverse-transform draw per row, beside its reference; and the
logprobs of chosen tokens with each row's top-N, without a ``[rows, vocab]`` log_softmax.

The torch path (``services.engine.sampler``) sorts every filtered row's whole vocabulary
(49,152 tokens for the built-in model) unless a 512-token window settles the cut, and passes
over ``[rows, vocab]`` tensors some ten times; a draw at temperature 0.7 and top-p 0.9 cost
~0.6 ms a row on a 2-core EPYC, more than the model's forward pass at batch 32. The kernel
ranks only the tokens that can make the cut and draws in a few passes of one row held in
cache (``scripts/bench_sampling.py`` measures both). Built on first use like the other CPU
kernels (``kernels.native``); without a compiler ``available()`` is False and callers keep the
torch path. Imports nothing of ``services``.

The definition (both here and in C), per row of logits ``l`` with temperature ``T`` > 0:
weights ``e_i = exp(l_i / T - max_j l_j / T)`` (-inf and NaN logits weigh 0); min-p (Nguyen et
al. 2024) zeroes ``e_i < min_p`` (a probability below ``min_p`` times the largest); top-k keeps
the ``k`` highest logits (ties: the lower token id first); top-p (Holtzman et al. 2020), over
the top-k renormalised as in vLLM, keeps a token while the mass ranked before it is below
``top_p`` of the kept mass (the first always); then the token is the first, in vocabulary
order, whose running sum of kept weights exceeds ``u`` times their total. Sums are in float64
in one fixed order, so a row's token is a function of the row and its settings alone (not of
the batch or the thread count). The same distribution as the torch path; where a draw falls
within rounding of a boundary the two may pick neighbouring tokens.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import numpy as np
import torch

from kernels.cpu_attention import build_shared_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "sampling.c"
_ERRORS = {2: "bad shape (vocabulary of 1 to 2^31 - 1 tokens)", 3: "rows: a row outside the logits",
           6: "a setting out of range (temperature > 0, top_p in (0, 1], min_p in [0, 1], "
              "top_k >= 0, uniforms in [0, 1))", 7: "out of memory"}
_LOGPROB_ERRORS = {2: "bad shape (vocabulary of 1 to 2^31 - 1 tokens, num_top 0 to vocabulary)",
                   3: "rows or chosen: a row outside the logits or a token outside the "
                      "vocabulary", 7: "out of memory"}
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The loaded kernel (built on first call); ``None``, logged once, when it cannot be built."""
    try:
        return load(build_shared_library(SOURCE))
    except (RuntimeError, OSError) as e:
        log.warning("CPU sampling kernel unavailable, using torch ops: %s", e)
        return None


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` (a build of ``SOURCE``) with its function's signature. Raises
    ``OSError`` when it does not load."""
    so = ctypes.CDLL(str(path))
    so.tandem_sample_rows_f32.argtypes = [_PTR, _I64, _I64, _PTR, _I64] + [_PTR] * 6 + [_INT]
    so.tandem_logprobs_rows_f32.argtypes = ([_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64]
                                            + [_PTR] * 3 + [_INT])
    return so


def available() -> bool:
    """Whether the C kernel is built and loaded (building it if needed)."""
    return lib() is not None


def sample_rows(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                uniforms: torch.Tensor) -> torch.Tensor:
    """One token per entry of ``rows`` from ``logits[rows[j]]`` under the j-th settings (the
    module docstring's definition).

    logits: ``[n, vocab]`` float32, contiguous, CPU; rows: ``[r]`` int64 (rows of logits);
    temperature, top_p, min_p, uniforms: ``[r]`` float32; top_k: ``[r]`` int64 (0: off).
    Returns ``[r]`` int64 token ids. Raises ``ValueError`` for tensors of another dtype,
    device or shape, a row outside the logits or a setting out of range (temperature > 0,
    top_p in (0, 1], min_p in [0, 1], top_k >= 0, uniforms in [0, 1)); ``RuntimeError``
    when the kernel is not built.
    """
    so = _checked(logits, ((rows, torch.int64), (temperature, torch.float32),
                           (top_k, torch.int64), (top_p, torch.float32), (min_p, torch.float32),
                           (uniforms, torch.float32)))
    r = rows.shape[0]
    out = torch.empty(r, dtype=torch.int64)
    rc = so.tandem_sample_rows_f32(logits.data_ptr(), logits.shape[0], logits.shape[1],
                                   rows.data_ptr(), r, temperature.data_ptr(), top_k.data_ptr(),
                                   top_p.data_ptr(), min_p.data_ptr(), uniforms.data_ptr(),
                                   out.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"sample_rows: {_ERRORS.get(rc, f'error {rc}')}")
    return out


def logprobs_rows(logits: torch.Tensor, rows: torch.Tensor, chosen: torch.Tensor,
                  num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each draw's logprob and its row's most likely tokens under ``log_softmax`` of the logits
    (what ``torch.log_softmax`` then ``gather`` and ``topk`` give, to float32 rounding): the
    sum of the row's exponentials in float64, in one order, so a row's values depend on it
    alone, and no ``[rows, vocab]`` tensor is written.

    logits: ``[n, vocab]`` float32, contiguous, CPU; rows, chosen: ``[r]`` int64 (each draw's
    row of logits and token); num_top: 0 to vocab. Returns (``[r]`` float32 logprobs of
    ``chosen``, ``[r, num_top]`` int64 top ids, most likely first, ties by the lower id,
    ``[r, num_top]`` float32 their logprobs). Raises ``ValueError`` for tensors of another
    dtype, device or shape, a row or token out of range, or ``num_top`` outside 0..vocab;
    ``RuntimeError`` when the kernel is not built.
    """
    so = _checked(logits, ((rows, torch.int64), (chosen, torch.int64)))
    r = rows.shape[0]
    lp = torch.empty(r, dtype=torch.float32)
    top_ids = torch.empty((r, num_top), dtype=torch.int64)
    top_lp = torch.empty((r, num_top), dtype=torch.float32)
    rc = so.tandem_logprobs_rows_f32(logits.data_ptr(), logits.shape[0], logits.shape[1],
                                     rows.data_ptr(), r, chosen.data_ptr(), num_top,
                                     lp.data_ptr(), top_ids.data_ptr(), top_lp.data_ptr(),
                                     torch.get_num_threads())
    if rc:
        raise ValueError(f"logprobs_rows: {_LOGPROB_ERRORS.get(rc, f'error {rc}')}")
    return lp, top_ids, top_lp


def _checked(logits: torch.Tensor, per_row: tuple[tuple[torch.Tensor, torch.dtype], ...],
             ) -> ctypes.CDLL:
    """The kernel, once ``logits`` (``[n, vocab]`` float32) and the ``[r]`` per-row tensors
    (each of its dtype; the first is ``rows``) are contiguous CPU tensors of those shapes."""
    so = lib()
    if so is None:
        raise RuntimeError("the CPU sampling kernel is not built (no C compiler?)")
    r = per_row[0][0].shape[0]
    for t, dtype in ((logits, torch.float32), *per_row):
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"the sampling kernels take contiguous CPU tensors: {dtype} "
                             f"expected, got {t.dtype} on {t.device}")
    if logits.dim() != 2 or any(t.shape != (r,) for t, _ in per_row):
        raise ValueError(f"logits {tuple(logits.shape)} must be [n, vocab] and every setting "
                         f"[{r}] like rows")
    return so


def survivors_reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                        min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The definition in numpy over one row (``[vocab]`` float32), sorting the whole row: the
    surviving token ids in vocabulary order and their weights (float32 ``e_i``, as the kernel
    computes them to rounding)."""
    x = logits.astype(np.float32) / np.float32(temperature)
    live = x > -np.inf  # NaN too: not greater
    top = x[live].max()
    e = np.where(live, np.exp((x - top).astype(np.float64)), 0.0)
    e[e < min_p] = 0.0
    ids = np.flatnonzero(e > 0)
    ranked = ids[np.lexsort((ids, -logits[ids]))]  # highest logit first, then the lower id
    if 0 < top_k < len(ranked):
        ranked = ranked[:top_k]
    w = e[ranked]
    before = np.cumsum(w) - w
    keep = before < top_p * w.sum()
    keep[0] = True
    kept = np.sort(ranked[keep] if top_p < 1.0 else ranked)
    return kept, e[kept]
