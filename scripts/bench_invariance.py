"""What batch invariance costs: this tree's engine against a baseline tree's, interleaved.

``python -m scripts.bench_invariance --baseline DIR`` (DIR: a checkout of the commit to compare
with, e.g. ``git worktree add /tmp/base 1245b32``; its kernels build into the same cache under
their own hash) runs, ``--rounds`` times in alternation, one fresh process per tree and thread
count that loads the built-in model in the default precision and measures, in process:

- decode at batch 1: ms per token over 128 tokens after a 16-token prompt (TPOT);
- decode throughput at batch 16 and 64: output tokens/s of decode steps only (prefill
  excluded), 16-token random prompts, 64 tokens each;
- prefill throughput: prompt tokens/s of four 512-token prompts, one step budget of 2048.

On one thread the figures are per CPU second of the process (``time.process_time``), which a
neighbour on a shared machine disturbs far less than wall time; on more, per wall second.

Prints each round's figures and the median of each figure per tree, with new / baseline, and
writes JSON (``--out``). The two trees run alternately in one run, so a neighbour on a shared
machine slows both alike; compare figures only within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# runs inside each tree (its own engine and kernels); only API both trees have
CHILD = r"""
import json, random, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
# one thread: CPU seconds of this process (a neighbour on a shared core does not count);
# more: wall seconds (the threads' CPU time would count their waits at the barriers)
clock = time.process_time if int(sys.argv[1]) == 1 else time.perf_counter
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.sampling_params import SamplingParams
e = LLMEngine(EngineConfig(dtype="auto", quantization="auto", num_kv_blocks=2048,
                           max_num_seqs=64, max_num_batched_tokens=2048))
e.warm_up()
rng = random.Random(0)
def prompt(n):
    return [rng.randrange(17, e.model_config.vocab_size) for _ in range(n)]
def decode(batch, tokens, tag):
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        e.add_request(e.make_request(f"{tag}-{i}", prompt(16), params))
    started = set()
    while len(started) < batch:
        started.update(o.request_id for o in e.step())
    n, t0 = 0, clock()
    while e.has_work():
        n += sum(len(o.new_token_ids) for o in e.step())
    return n, clock() - t0
out = {}
n, s = decode(1, 129, "one")
out["tpot_ms_batch1"] = s / n * 1e3
for b in (16, 64):
    n, s = decode(b, 65, f"b{b}")
    out[f"decode_tok_s_batch{b}"] = n / s
params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
for i in range(4):
    e.add_request(e.make_request(f"p-{i}", prompt(512), params))
t0 = clock()
while e.has_work():
    e.step()
out["prefill_tok_s"] = 4 * 512 / (clock() - t0)
print(json.dumps(out))
"""
HIGHER_IS_BETTER = {"tpot_ms_batch1": False}


def measure(tree: Path, threads: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(threads)], cwd=tree,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="checkout of the baseline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="torch threads, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("results/bench_invariance.json"))
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    trees = {"baseline": args.baseline.resolve(), "new": here}
    rows: list[dict] = []
    for r in range(args.rounds):
        for threads in [int(t) for t in args.threads.split(",")]:
            for name in (("baseline", "new") if r % 2 == 0 else ("new", "baseline")):
                fig = measure(trees[name], threads)
                rows.append({"round": r, "tree": name, "threads": threads, **fig})
                print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for threads in sorted({row["threads"] for row in rows}):
        for key in HIGHER_IS_BETTER.keys() | {k for k in rows[0] if k.endswith("tok_s")
                                              or k.startswith("decode")}:
            med = {name: statistics.median(row[key] for row in rows
                                           if row["tree"] == name and row["threads"] == threads)
                   for name in trees}
            summary[f"{key}@{threads}t"] = {**med, "new/baseline": med["new"] / med["baseline"]}
    print(f"{'figure':32s} {'baseline':>10s} {'new':>10s} {'new/baseline':>13s}")
    for key, v in summary.items():
        print(f"{key:32s} {v['baseline']:10.2f} {v['new']:10.2f} {v['new/baseline']:13.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "summary": summary,
                                    "baseline": str(trees["baseline"])}, indent=1))


if __name__ == "__main__":
    main()
