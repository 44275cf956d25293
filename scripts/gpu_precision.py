"""Float32 on the GPU against float32 on the CPU, for transformers and for Tandem, greedy.

The oracle of the CPU engine is transformers in float32, token for token. On a GPU the same
arithmetic runs in other kernels (cuBLAS GEMMs, SDPA, our Triton attention), with other
reduction orders, so equal tokens are not given. This script measures where each pair parts:
the 8 oracle chat prompts, ``--tokens`` greedy tokens each (the same prompt token ids
everywhere), and for every pair of {transformers, Tandem} x {cpu, cuda} the first position where
the two greedy sequences differ (None: identical). At each divergence of Tandem-cuda from
transformers-cuda it prints both sides' top-2 logprob margin there: a margin of ~1e-5 is a near
tie that rounding alone flips, a large one is a real error.

In bfloat16, Tandem (CUDA graphs) against transformers, both on the GPU: first divergence per
prompt (bf16 rounding differs between any two implementations; the issue asks for it reported).

Then batch invariance in bfloat16 on the GPU: the 8 prompts generated together (one batch,
CUDA graphs on) against each generated alone (batch 1), the prefix cache off so that only the
batch differs; first divergence per prompt.

Then migration (issue 37), in float32 and in bfloat16 on the GPU: the gateway resumes a stream
whose decode worker died with prompt + the tokens so far as a new prompt
(``services/gateway/dispatch.py``), so the KV of those tokens comes from a prefill, not from
the decode steps that made them. ``migration_vs_uninterrupted``: the 8 prompts' streams cut
after half of ``--tokens`` and resumed so, against the uninterrupted ones; first divergence
per prompt.

    python -m scripts.gpu_precision --out bench-results/gpu_precision.json [--tokens 64]

Raises SystemExit without CUDA.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from loadtest.chat_prompts import ORACLE_PROMPTS
from services.engine.engine import EngineConfig
from services.engine.llm import LLM
from services.engine.model_files import default_model_path
from services.engine.sampling_params import SamplingParams


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def transformers_greedy(device: str, prompts: list[list[int]], tokens: int, eos: int,
                        dtype: torch.dtype = torch.float32,
                        ) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy ids and, per position, the top-2 log-softmax margin; ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype).to(device).eval()
    ids_out, margins = [], []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=eos,
                                 output_logits=True, return_dict_in_generate=True)
            ids_out.append(out.sequences[0, len(ids):].tolist())
            top2 = [torch.log_softmax(lg[0].float(), -1).topk(2).values for lg in out.logits]
            margins.append([float(t[0] - t[1]) for t in top2])
    del model
    return ids_out, margins


def tandem_greedy(device: str, prompts: list[list[int]], tokens: int, eager: bool,
                  dtype: str = "float32") -> tuple[list[list[int]], list[list[float]]]:
    llm = LLM(EngineConfig(device=device, dtype=dtype, num_kv_blocks=1024,
                           enforce_eager=eager))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params)
    margins = [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in outs]
    return [o.token_ids for o in outs], margins


def bf16_alone_vs_together(prompts: list[list[int]], tokens: int) -> list[int | None]:
    """First divergence, per prompt, of its bf16 greedy tokens alone from those in the batch."""
    llm = LLM(EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=1024,
                           enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    return [first_divergence(a, b) for a, b in zip(alone, together)]


def migration_vs_uninterrupted(device: str, dtype: str, prompts: list[list[int]], tokens: int,
                               at: int) -> list[int | None]:
    """First divergence (from the first output token), per prompt, of a stream resumed after
    ``at`` tokens as a migration resumes it (prompt + those tokens as the prompt, the rest to
    generate) from the uninterrupted stream; None: identical. Greedy, the prompts in one batch
    both times, the prefix cache off (another worker holds none of the stream's KV)."""
    llm = LLM(EngineConfig(device=device, dtype=dtype, num_kv_blocks=1024,
                           enable_prefix_caching=False))
    whole = [o.token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))]
    rest = llm.generate([p + w[:at] for p, w in zip(prompts, whole)],
                        SamplingParams(temperature=0.0, max_tokens=tokens - at, ignore_eos=True))
    return [first_divergence(w, w[:at] + r.token_ids) for w, r in zip(whole, rest)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench-results/gpu_precision.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_precision needs a CUDA device")
    from services.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(default_model_path())
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
               for p in ORACLE_PROMPTS]
    runs, margins = {}, {}
    for device in ("cpu", "cuda"):
        runs[f"transformers-{device}"], margins[f"transformers-{device}"] = transformers_greedy(
            device, prompts, args.tokens, tok.eos_token_id)
    runs["tandem-cpu"], margins["tandem-cpu"] = tandem_greedy("cpu", prompts, args.tokens, True)
    for eager in (True, False):
        name = "tandem-cuda" + ("-eager" if eager else "-graphs")
        runs[name], margins[name] = tandem_greedy("cuda", prompts, args.tokens, eager)
    # bf16, the GPU's serving precision: Tandem (graphs) against transformers, both on the GPU
    runs["transformers-cuda-bf16"], margins["transformers-cuda-bf16"] = transformers_greedy(
        "cuda", prompts, args.tokens, tok.eos_token_id, torch.bfloat16)
    runs["tandem-cuda-bf16"], margins["tandem-cuda-bf16"] = tandem_greedy(
        "cuda", prompts, args.tokens, False, "bfloat16")
    pairs = [("transformers-cuda", "transformers-cpu"), ("tandem-cpu", "transformers-cpu"),
             ("tandem-cuda-eager", "tandem-cpu"), ("tandem-cuda-eager", "transformers-cuda"),
             ("tandem-cuda-graphs", "tandem-cuda-eager"),
             ("tandem-cuda-bf16", "transformers-cuda-bf16")]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "tokens": args.tokens, "first_divergence": {}, "margins_at_divergence": []}
    for a, b in pairs:
        div = [first_divergence(x, y) for x, y in zip(runs[a], runs[b])]
        report["first_divergence"][f"{a} vs {b}"] = div
        print(f"{a:>20} vs {b:<20} first divergence per prompt: {div}")
    for i, pos in enumerate(report["first_divergence"]["tandem-cuda-eager vs transformers-cuda"]):
        if pos is None:
            continue
        row = {"prompt": i, "position": pos,
               "tandem_cuda_margin": margins["tandem-cuda-eager"][i][pos],
               "transformers_cuda_margin": margins["transformers-cuda"][i][pos],
               "transformers_cpu_margin": margins["transformers-cpu"][i][pos]}
        report["margins_at_divergence"].append(row)
        print(f"prompt {i} diverges at {pos}: top-2 margin tandem-cuda "
              f"{row['tandem_cuda_margin']:.2e}, transformers-cuda "
              f"{row['transformers_cuda_margin']:.2e}, transformers-cpu "
              f"{row['transformers_cpu_margin']:.2e}")
    report["bf16_alone_vs_together"] = bf16_alone_vs_together(prompts, args.tokens)
    print(f"bf16 cuda, each prompt alone vs all 8 together, first divergence per prompt: "
          f"{report['bf16_alone_vs_together']}")
    for dtype in ("float32", "bfloat16"):
        report[f"migration_{dtype}"] = div = migration_vs_uninterrupted(
            "cuda", dtype, prompts, args.tokens, args.tokens // 2)
        print(f"{dtype} cuda, streams resumed after {args.tokens // 2} tokens as a migration "
              f"resumes them vs uninterrupted, first divergence per prompt: {div}")
    report["runs"] = runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
