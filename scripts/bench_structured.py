"""What structured outputs cost a batch: output tokens/s of a 16-sequence batch in which 0, 1 or
16 sequences are held to a JSON schema (llguidance's token mask applied in the batched sampler,
``services/engine/grammars.py``), the engine in-process.

Every sequence decodes exactly ``--max-tokens`` tokens (free ones ignore EOS; constrained ones
write a JSON array of at least that many integers, so their grammar never ends first); the three
batch kinds are run interleaved, ``--rounds`` times each, so a shared machine's noise falls on
all of them alike. Also the time one constrained row's token mask takes to fill
(``Matchers.fill`` for a small object schema, mean over ``MASK_REPEATS``). Prints a table and
writes JSON (``--out``).

    python -m scripts.bench_structured --rounds 3 --out results/bench_structured.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from services.engine.engine import EngineConfig, LLMEngine
from services.engine.sampling_params import SamplingParams, StructuredOutput
from services.engine.tokenizer import Tokenizer

BATCH = 16
KINDS = (0, 1, 16)  # constrained sequences in the batch
MASK_REPEATS = 1000
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}


def mask_microseconds(engine: LLMEngine) -> float:
    """Mean microseconds of one ``Matchers.fill`` (a row of the step's token bitmask) for a
    small object schema at the start of its output."""
    import numpy as np

    matchers = engine.runner.input_batch.matchers
    matchers.add("mask-timing", "json", json.dumps(PERSON))
    row = np.zeros(matchers.words, dtype=np.int32)
    t0 = time.perf_counter()
    for _ in range(MASK_REPEATS):
        matchers.fill("mask-timing", row)
    seconds = time.perf_counter() - t0
    matchers.remove("mask-timing")
    return seconds / MASK_REPEATS * 1e6


def batch_params(num_constrained: int, max_tokens: int) -> list[SamplingParams]:
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "minItems": max_tokens, "x-guidance": {"whitespace_flexible": False}}
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, structured_output=
                                 StructuredOutput(format="json", spec=json.dumps(schema)))
    free = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, ignore_eos=True)
    return [constrained if i < num_constrained else free for i in range(BATCH)]


def run_batch(engine: LLMEngine, prompt: list[int], params: list[SamplingParams], tag: str) -> tuple[int, float]:
    """(output tokens, seconds) of one batch run to its end."""
    for i, p in enumerate(params):
        engine.add_request(engine.make_request(f"{tag}-{i}", prompt, p))
    tokens, t0 = 0, time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            tokens += len(out.new_token_ids)
    return tokens, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(quantization=args.quantization, dtype=args.dtype,
                                    num_kv_blocks=1024, max_num_seqs=BATCH))
    engine.warm_up()
    tok = Tokenizer.load(engine.config.model)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "List numbers as JSON."}]))
    run_batch(engine, prompt, batch_params(16, 8), "warm")  # compile the grammar once
    rates: dict[int, list[float]] = {k: [] for k in KINDS}
    for r in range(args.rounds):
        for k in KINDS:
            tokens, seconds = run_batch(engine, prompt, batch_params(k, args.max_tokens), f"r{r}k{k}")
            assert tokens == BATCH * args.max_tokens, tokens
            rates[k].append(tokens / seconds)
    rows = {k: {"constrained": k, "batch": BATCH, "output_tokens_per_s_median": statistics.median(v),
                "output_tokens_per_s": v} for k, v in rates.items()}
    print(f"{'constrained':>11} {'tokens/s (median)':>18}  rounds")
    for k, row in rows.items():
        print(f"{k:>11} {row['output_tokens_per_s_median']:>18.1f}  "
              + " ".join(f"{v:.1f}" for v in row["output_tokens_per_s"]))
    mask_us = mask_microseconds(engine)
    print(f"one constrained row's token mask: {mask_us:.0f} us")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"max_tokens": args.max_tokens, "precision": str(engine.precision),
                                        "mask_us": mask_us, "rows": list(rows.values())}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
