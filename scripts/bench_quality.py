"""What each precision costs in quality, on a public-domain text shipped in the repository
(``python -m scripts.bench_quality``).

The built-in model reads ``loadtest/texts/public_domain.txt`` (2,890 tokens, no chat template)
teacher-forced, in one prefill per precision (``scripts.eval_loglik``'s method); per position
it has the full next-token distribution. Against the float32 oracle (``float32:none``: the
file's weights dequantized, token-exact with transformers) each precision gets:

- perplexity of the text, ``exp(-mean log p(token_i | tokens_<i))``;
- mean KL(oracle || precision) over positions, nats;
- top-1 agreement: positions whose most likely next token is the oracle's;
- the largest logprob gap: max over positions of ``|log p(text token) - log p_oracle(...)|``;
- ``kl_top20``: KL restricted to the oracle's 20 most likely tokens, a token missing from the
  other side's top 20 counted at its 20th logprob (what a peer's ``top_logprobs`` allows).

Precisions (``--modes``): ``auto`` (the default: the GGUF's Q4_1 weights, int8 activations),
``auto_kv32`` (the same with a float32 KV cache, ``--kv-cache-dtype float32``; ``auto``'s is
float16), ``f32`` (the linear layers as float32 rows through the same C kernels; the Q8_0
embedding / LM head stay Q8_0), ``bfloat16`` (dense torch modules in bf16), ``none`` (the
oracle itself).

``--peer URL``: an OpenAI-compatible server with the same GGUF (llama.cpp's llama-server, or
Tandem itself), asked at each position for one greedy token with ``logprobs: 20`` on
``/v1/completions`` with the prefix as token ids; from its top 20 come top-1 agreement,
``kl_top20`` and the logprob gap where the text's token is among them (``coverage``: the share
of positions where it is). ``--positions N`` asks about every k-th position only.

Prints a table and writes JSON (``--out``).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

TEXT_FILE = Path(__file__).resolve().parents[1] / "loadtest" / "texts" / "public_domain.txt"
# mode -> (dtype, quantization, kv_cache_dtype)
MODES = {"auto": ("auto", "auto", "auto"), "auto_kv32": ("auto", "auto", "float32"),
         "f32": ("float32", "f32", "auto"), "bfloat16": ("bfloat16", "none", "auto"),
         "none": ("float32", "none", "auto")}
TOP = 20


@torch.inference_mode()
def text_logprobs(ids: list[int], dtype: str, quantization: str, kv_cache_dtype: str,
                  ) -> tuple[torch.Tensor, str]:
    """``[n - 1, vocab]`` float32 log-softmax of the next-token logits at positions 0..n-2 (one
    prefill of ``ids``) and the resolved precision, for an engine built in that precision."""
    from services.engine.attention import AttentionMetadata
    from services.engine.engine import EngineConfig, LLMEngine

    n = len(ids)
    engine = LLMEngine(EngineConfig(dtype=dtype, quantization=quantization,
                                    kv_cache_dtype=kv_cache_dtype,
                                    num_kv_blocks=n // 16 + 2, max_model_len=n + 16))
    model, blocks = engine.runner.model, (n + 15) // 16
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.arange(blocks)[None],
                             seq_lens=torch.tensor([n]), query_start_loc=[0, n], num_decode_seqs=0)
    hidden = model(torch.tensor(ids), torch.arange(n), engine.kv_cache, meta)
    logp = model.compute_logits(hidden[:-1]).float().log_softmax(-1)
    kv = "" if engine.layout.dtype == engine.precision.dtype else f" kv {engine.layout.dtype}"
    return logp, f"{engine.precision.dtype}:{engine.precision.quantization}{kv}"


def kl_top(oracle_top: tuple[torch.Tensor, torch.Tensor], other_ids: torch.Tensor,
           other_lp: torch.Tensor) -> torch.Tensor:
    """Per position: sum over the oracle's top tokens v of p_o(v) (log p_o(v) - log q(v)), with
    q(v) from the other side's top list (``[P, TOP]`` ids and logprobs), or its last logprob
    when v is not in it."""
    o_lp, o_ids = oracle_top
    match = o_ids[:, :, None] == other_ids[:, None, :]  # [P, TOP, TOP]
    q = torch.where(match.any(-1), (other_lp[:, None, :] * match).sum(-1),
                    other_lp[:, -1:].expand_as(o_lp))
    return (o_lp.exp() * (o_lp - q)).sum(-1)


def compare(logp: torch.Tensor, oracle: torch.Tensor, ids: list[int]) -> dict:
    target = torch.tensor(ids[1:])[:, None]
    lp, lp_o = logp.gather(1, target)[:, 0], oracle.gather(1, target)[:, 0]
    kl = (oracle.exp() * (oracle - logp)).sum(-1)
    top_lp, top_ids = logp.topk(TOP, dim=-1)
    return {"perplexity": math.exp(-lp.mean().item()),
            "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "top1_agreement": (logp.argmax(-1) == oracle.argmax(-1)).float().mean().item(),
            "max_logprob_gap": (lp - lp_o).abs().max().item(),
            "kl_top20": kl_top(oracle.topk(TOP, dim=-1), top_ids, top_lp).mean().item()}


def peer_top(url: str, ids: list[int], positions: list[int], tokenizer) -> list[dict[int, float]]:
    """The peer's top-``TOP`` next tokens (id -> logprob) after ``ids[:p + 1]`` for each p."""
    import httpx

    out = []
    with httpx.Client(base_url=url.rstrip("/"), timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for p in positions:
            r = client.post("/v1/completions", json={
                "model": model, "prompt": ids[:p + 1], "max_tokens": 1, "temperature": 0,
                "logprobs": TOP})
            if r.status_code != 200:
                raise RuntimeError(f"peer answered {r.status_code}: {r.text[:500]}")
            out.append(_top_of(r.json()["choices"][0]["logprobs"], tokenizer))
    return out


def _top_of(logprobs: dict, tokenizer) -> dict[int, float]:
    """id -> logprob from a completions ``logprobs`` object: llama-server's (``content`` entries
    with ``id``) or OpenAI's legacy form (``top_logprobs`` keyed by token text)."""
    if "content" in logprobs:
        return {int(t["id"]): float(t["logprob"]) for t in logprobs["content"][0]["top_logprobs"]}
    top = {}
    for text, lp in logprobs["top_logprobs"][0].items():
        tok = tokenizer.encode(text)
        if len(tok) == 1:
            top[tok[0]] = float(lp)
    return top


def compare_peer(tops: list[dict[int, float]], oracle: torch.Tensor, ids: list[int],
                 positions: list[int]) -> dict:
    o = oracle[positions]
    o_top = o.topk(TOP, dim=-1)
    width = max(len(t) for t in tops)
    p_lp = torch.tensor([sorted(t.values(), reverse=True) + [min(t.values())] * (width - len(t))
                         for t in tops])
    p_ids = torch.tensor([sorted(t, key=t.get, reverse=True) + [-1] * (width - len(t))
                          for t in tops])
    gaps = [abs(t[ids[p + 1]] - o[i, ids[p + 1]].item()) for i, (p, t) in
            enumerate(zip(positions, tops)) if ids[p + 1] in t]
    return {"positions": len(positions), "coverage": len(gaps) / len(positions),
            "top1_agreement": sum(max(t, key=t.get) == int(o[i].argmax())
                                  for i, t in enumerate(tops)) / len(tops),
            "max_logprob_gap": max(gaps) if gaps else None,
            "kl_top20": kl_top(o_top, p_ids, p_lp).mean().item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES), help=f"some of {', '.join(MODES)}")
    ap.add_argument("--peer", help="base URL of an OpenAI-compatible server with the same GGUF")
    ap.add_argument("--positions", type=int, default=0,
                    help="ask the peer about this many positions, evenly spread (0: all)")
    ap.add_argument("--out", type=Path, default=Path("results/quality.json"))
    args = ap.parse_args()
    from services.engine.model_files import default_model_path
    from services.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(default_model_path())
    ids = tokenizer.encode(TEXT_FILE.read_text())
    oracle, _ = text_logprobs(ids, *MODES["none"])
    results: dict[str, dict] = {}
    for mode in args.modes.split(","):
        logp, resolved = (oracle, "float32:none") if mode == "none" else text_logprobs(
            ids, *MODES[mode])
        results[mode] = {"resolved": resolved, "tokens": len(ids), **compare(logp, oracle, ids)}
        print(json.dumps({mode: results[mode]}), flush=True)
    if args.peer:
        n = len(ids) - 1
        step = max(1, n // args.positions) if args.positions else 1
        positions = list(range(0, n, step))
        results["peer"] = {"url": args.peer, **compare_peer(
            peer_top(args.peer, ids, positions, tokenizer), oracle, ids, positions)}
        print(json.dumps({"peer": results["peer"]}), flush=True)
    cols = ("perplexity", "kl_mean", "top1_agreement", "max_logprob_gap", "kl_top20")
    print(f"{'precision':10s} {'resolved':24s} " + " ".join(f"{c:>15s}" for c in cols))
    for mode, r in results.items():
        cells = [f"{r[c]:15.4f}" if isinstance(r.get(c), float) else f"{'-':>15s}" for c in cols]
        print(f"{mode:10s} {r.get('resolved', r.get('url', '')):24.24s} " + " ".join(cells))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
