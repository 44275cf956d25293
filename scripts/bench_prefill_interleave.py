"""TTFT of a short prompt queued right behind a long one on a prefill-role engine, in-process,
with and without ``long_prefill_token_threshold`` (issue 10, finding 4).

    python -m scripts.bench_prefill_interleave [--long 8000] [--short 20] [--thresholds 0,512]

Both requests are added before the first step (the short one second), as a prefill worker's
queue holds them; each samples one token (a prefill worker's job). TTFT is measured from the
add to the step that returns the short request's token; the run stops there (the long prompt's
remaining chunks are not computed). Prints one JSON line per threshold. Compare figures only
within one run: the machine is shared.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from services.engine.engine import EngineConfig, LLMEngine
from services.engine.loader import load_model
from services.engine.model_files import default_model_path
from services.engine.sampling_params import SamplingParams


def measure(weights, threshold: int, long_len: int, short_len: int, budget: int) -> dict:
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=budget, num_kv_blocks=long_len // 16 + 64,
                                    long_prefill_token_threshold=threshold), weights=weights)
    engine.warm_up()
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    ids = lambda n: torch.randint(17, vocab, (n,), generator=gen).tolist()  # noqa: E731
    first = SamplingParams(temperature=0, max_tokens=1)
    t0 = time.perf_counter()
    long = engine.make_request("long", ids(long_len), first)
    engine.add_request(long)
    engine.add_request(engine.make_request("short", ids(short_len), first))
    steps = 0
    while not any(out.request_id == "short" for out in engine.step()):
        steps += 1
    return {"long_prefill_token_threshold": threshold, "long_tokens": long_len,
            "short_tokens": short_len, "max_num_batched_tokens": budget, "steps": steps + 1,
            "long_tokens_computed": long.num_computed_tokens,
            "ttft_short_s": round(time.perf_counter() - t0, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--long", type=int, default=8000)
    p.add_argument("--short", type=int, default=20)
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--thresholds", default="512,0")
    p.add_argument("--num-threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.num_threads)
    weights = load_model(default_model_path())
    for threshold in map(int, args.thresholds.split(",")):
        print(json.dumps(measure(weights, threshold, args.long, args.short, args.budget)), flush=True)


if __name__ == "__main__":
    main()
