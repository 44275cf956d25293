"""What quantization costs, as a bound: mean log-likelihood of the fixed text of
``scripts/eval_loglik.py`` per quantized format against float32 (the file's weights dequantized,
the transformers-exact oracle)."""
from __future__ import annotations

import pytest

from kernels import quant
from scripts.eval_loglik import evaluate

pytestmark = pytest.mark.skipif(not quant.available(), reason="quantized kernel not built")


def test_quantized_log_likelihood_is_close_to_float32():
    r = evaluate(["float32:none", "float32:q4_1", "float32:q8_0", "float32:q4_0"])
    ref = r["float32:none"]["mean_log_likelihood"]
    assert -4.5 < ref < -2.5  # a coherent model on English prose (measured -3.35 nats/token)
    gap = {m: abs(v["mean_log_likelihood"] - ref) for m, v in r.items()}
    assert {v["resolved"] for v in r.values()} == set(r)  # nothing fell back to another format
    # q4_1 runs the very weights of the reference; only the activations are rounded, to int8 per
    # 32-block (relative error <= 1/254 of the block's max): a per-token effect well under
    # 0.02 nats (measured 0.002). q8_0 adds a second rounding of each weight to 1/254 of its
    # block's max: the same order (measured 0.005).
    assert gap["float32:q4_1"] < 0.02
    assert gap["float32:q8_0"] < 0.02
    # q4_0 re-rounds each 4-bit Q4_1 weight to a 4-bit grid without an offset: up to half a
    # step (max|w| / 16) per weight, as large as the file's own quantization; measured 0.18
    # nats (perplexity +20%). The bound admits at most +35% perplexity (ln 1.35 = 0.30).
    assert gap["float32:q4_0"] < 0.30
    assert gap["float32:q4_0"] > gap["float32:q4_1"]  # a lossier format must cost more
