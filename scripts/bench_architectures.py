"""Decode speed of every supported architecture beside Llama's, one run, interleaved
(``python -m scripts.bench_architectures``).

Each architecture's tiny checkpoint (``scripts/tiny_checkpoints.py``; ``--hidden``,
``--layers`` and ``--ffn`` make it bigger) runs in the float32 module path (a Hugging Face
directory, quantization none) and from its GGUF file in ``--gguf-type`` with quantization
``auto`` (the fused C forward pass where it serves the architecture, else the module path).
Per run: a batch of ``--batch`` greedy requests (``--prompt`` random tokens each) is prefilled,
then ``--tokens`` decode steps are timed (CPU process time and wall time). Architectures
alternate within each of ``--rounds`` rounds; the median round is reported: decode tokens/s,
the parameters a token's forward pass multiplies (all but an untied embedding table, which is
only looked up), and tokens/s x those parameters (equal across architectures when each costs
what its size says; at tiny sizes per-step overheads dominate). Prints a table and writes JSON (``--out``). Compare figures only within
one run.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from scripts.tiny_checkpoints import ARCHITECTURES, save_tiny, write_gguf


def decode_rate(path: str, quantization: str, batch: int, prompt: int, tokens: int,
                seed: int) -> tuple[float, float, str]:
    """(decode tokens per wall second, per CPU second, the precision chosen)."""
    from services.engine.engine import EngineConfig, LLMEngine
    from services.engine.sampling_params import SamplingParams

    e = LLMEngine(EngineConfig(model=path, quantization=quantization, num_kv_blocks=2048,
                               max_num_seqs=batch))
    e.warm_up()
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(17, e.model_config.vocab_size) for _ in range(prompt)]
        e.add_request(e.make_request(f"b{i}", ids, params))
    while e.metrics.num_steps == 0 or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in e.scheduler.running):
        e.step()  # prefill (and first tokens)
    done, wall, cpu = 0, time.perf_counter(), time.process_time()
    while e.has_work():
        done += sum(len(o.new_token_ids) for o in e.step())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return done / wall, done / cpu, e.precision.quantization


def active_parameters(path: Path) -> int:
    """Parameters a token multiplies: all but the embedding table when the LM head is its own."""
    from services.engine.loader import load_model

    config, state_dict = load_model(path)
    total = sum(t.numel() for t in state_dict.values())
    embedding = state_dict["model.embed_tokens.weight"].numel()
    return total - (0 if config.tie_word_embeddings else embedding)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHITECTURES))
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gguf-type", default="q8_0", choices=("f32", "q8_0", "q4_0", "q4_k_m"),
                        help="q4_k_m: llama.cpp's K-quant mix (rows of 256: --hidden and --ffn "
                             "multiples of 256), which auto serves re-encoded to Q8_0")
    parser.add_argument("--out", default="bench_architectures.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    archs = args.archs.split(",")
    size = dict(hidden_size=args.hidden, num_hidden_layers=args.layers,
                intermediate_size=args.ffn, head_dim=args.hidden // 4)
    tmp = Path(tempfile.mkdtemp(prefix="bench-archs-"))
    paths = {}
    for arch in archs:
        hf_dir = tmp / arch
        save_tiny(arch, hf_dir, **size)
        gguf = write_gguf(hf_dir, tmp / f"{arch}.{args.gguf_type}.gguf", args.gguf_type)
        paths[arch] = {"none": str(hf_dir), "auto": str(gguf), "params": active_parameters(hf_dir)}
    runs: dict[tuple[str, str], list[tuple[float, float, str]]] = {}
    for r in range(args.rounds):
        for arch in archs:  # interleaved: every architecture once per round
            for mode in ("none", "auto"):
                runs.setdefault((arch, mode), []).append(
                    decode_rate(paths[arch][mode], mode, args.batch, args.prompt, args.tokens, r))
    rows = []
    for (arch, mode), results in runs.items():
        wall = statistics.median(x[0] for x in results)
        cpu = statistics.median(x[1] for x in results)
        params = paths[arch]["params"]
        rows.append({"arch": arch, "quantization": mode, "ran_as": results[0][2],
                     "decode_tok_s": wall, "decode_tok_per_cpu_s": cpu, "params": params,
                     "tok_s_x_params": wall * params})
    print(f"{'arch':12} {'quant':5} {'ran as':6} {'tok/s':>9} {'tok/CPU s':>10} {'params':>10} "
          f"{'tok/s x params':>15}")
    for row in rows:
        print(f"{row['arch']:12} {row['quantization']:5} {row['ran_as']:6} "
              f"{row['decode_tok_s']:9.1f} {row['decode_tok_per_cpu_s']:10.1f} "
              f"{row['params']:10d} {row['tok_s_x_params']:15.3e}")
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
