"""Rows, ratios, targets and the printed table of the offline benchmark (``loadtest.offline``).

Throughput is in tokens (or requests) per wall-clock second; KV figures are fractions; the step
split is each phase's share of the summed step time, in percent.
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

from loadtest.workloads import Workload
from services.engine.metrics import STEP_PHASES

# The issue's targets: (key, description, comparison, threshold)
TARGETS = (
    ("continuous_vs_static_random", "continuous / static output tok/s on random", ">=", 2.0),
    ("continuous_vs_hf_chat", "continuous / HF generate output tok/s on chat", ">=", 4.0),
    ("kv_waste_continuous", "KV waste of continuous batching (worst workload)", "<", 0.04),
    ("decode_overhead_pct", "non-forward share of step time, decode-only probe (%)", "<=", 10.0),
    ("prefill_tokens_per_s", "prefill tok/s, one prompt of the probe length", ">=", 330.0),
)
_COMPARE = {">=": float.__ge__, "<": float.__lt__, "<=": float.__le__}
ENGINE_ONLY = ("mean_batch_size", "kv_usage", "kv_waste", "prefix_cache_hit_rate",
               "num_preemptions", "num_steps", "mean_step_ms", "step_split_pct")


def _split_pct(phase_s: dict[str, float]) -> dict[str, float]:
    total = sum(phase_s.values()) or 1.0
    return {p: 100.0 * phase_s[p] / total for p in STEP_PHASES}


def _throughput(workload: Workload, out_tokens: int, elapsed: float) -> dict:
    prompt = workload.num_prompt_tokens
    return {"workload": workload.name, "num_requests": len(workload.requests), "elapsed_s": elapsed,
            "prompt_tokens": prompt, "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (prompt + out_tokens) / elapsed,
            "requests_per_s": len(workload.requests) / elapsed}


def engine_row(system: str, workload: Workload, out_tokens: int, elapsed: float, m: dict) -> dict:
    """A report row from one engine run; ``m`` is ``EngineMetrics.to_dict()`` made per-run."""
    steps = max(m["num_steps"], 1)
    return {"system": system, **_throughput(workload, out_tokens, elapsed),
            "mean_batch_size": m["mean_batch_size"],
            "kv_usage": m["kv_used_blocks"] / steps / m["num_kv_blocks"],
            "kv_waste": m["kv_waste"], "prefix_cache_hit_rate": m["prefix_cache_hit_rate"],
            "num_preemptions": m["num_preemptions"], "num_steps": m["num_steps"],
            "mean_step_ms": 1e3 * sum(m["phase_s"].values()) / steps,
            "step_split_pct": _split_pct(m["phase_s"]), "metrics": m}


def hf_row(workload: Workload, result, batch_size: int) -> dict:
    """A report row from ``loadtest.hf_baseline.run_hf``: throughput only."""
    return {"system": "hf", **_throughput(workload, result.output_tokens, result.elapsed_s),
            **dict.fromkeys(ENGINE_ONLY),
            "hf": {"batch_size": batch_size, "num_batches": result.num_batches,
                   "generated_tokens": result.generated_tokens}}


def decode_row(batch: int, out_tokens: int, elapsed: float, m: dict) -> dict:
    """Decode-only probe: step split at a running batch of ``batch`` requests."""
    split = _split_pct(m["phase_s"])
    steps = max(m["num_steps"], 1)
    return {"batch_size": batch, "mean_batch_size": m["mean_batch_size"], "num_steps": m["num_steps"],
            "output_tokens": out_tokens, "elapsed_s": elapsed,
            "output_tokens_per_s": out_tokens / elapsed,
            "mean_step_ms": 1e3 * sum(m["phase_s"].values()) / steps,
            "step_split_pct": split, "overhead_pct": 100.0 - split["forward"]}


def prefill_row(prompt_tokens: int, engine_s: float, hf_s: float | None) -> dict:
    return {"prompt_tokens": prompt_tokens, "engine_s": engine_s,
            "engine_tokens_per_s": prompt_tokens / engine_s, "hf_forward_s": hf_s,
            "hf_tokens_per_s": prompt_tokens / hf_s if hf_s else None}


def _find(rows: list[dict], system: str, workload: str) -> dict | None:
    return next((r for r in rows if r["system"] == system and r["workload"] == workload), None)


def ratios(rows: list[dict], key: str = "output_tokens_per_s") -> dict[str, float | None]:
    """``key`` (output tok/s, or per CPU-second) of continuous batching over each baseline, per
    workload (None: not run)."""
    out = {}
    for workload in sorted({r["workload"] for r in rows}):
        cont = _find(rows, "continuous", workload)
        for base in ("static", "hf"):
            other = _find(rows, base, workload)
            ok = cont is not None and other is not None and bool(other.get(key))
            out[f"continuous_vs_{base}_{workload}"] = cont[key] / other[key] if ok else None
    return out


def targets(rows: list[dict], rat: dict, decode: dict | None, prefill: dict | None) -> list[dict]:
    """Each target with its measured value and PASS/FAIL (``passed`` None when not measured)."""
    wastes = [r["kv_waste"] for r in rows if r["system"] == "continuous"]
    values = {**rat, "kv_waste_continuous": max(wastes) if wastes else None,
              "decode_overhead_pct": decode["overhead_pct"] if decode else None,
              "prefill_tokens_per_s": prefill["engine_tokens_per_s"] if prefill else None}
    out = []
    for key, text, op, threshold in TARGETS:
        v = values.get(key)
        passed = None if v is None else _COMPARE[op](float(v), threshold)
        out.append({"name": key, "description": text, "value": v, "comparison": op,
                    "threshold": threshold, "passed": passed})
    return out


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU-seconds every core of the machine has been busy, or taken by the hypervisor, since
    boot; CPU-seconds of this process) from ``/proc/stat``; ``None`` where there is none."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy
    busy = sum(fields[:3]) + sum(fields[5:8])
    return busy / os.sysconf("SC_CLK_TCK"), time.process_time()


def other_cpu_cores(before: tuple[float, float] | None, wall_s: float) -> float | None:
    """Cores' worth of CPU that work outside this process used (or the hypervisor stole) on
    average since ``before`` (``cpu_seconds()``), over ``wall_s`` seconds."""
    after = cpu_seconds()
    if before is None or after is None or wall_s <= 0:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall_s


def cpu_shared(machine: dict) -> bool:
    """Whether other work took more than a quarter of a core on average during the runs. (The
    load average is no guide: it still counts work that ended before the run began.)"""
    other = machine.get("other_cpu_cores")
    return other is not None and other > 0.25


def assemble(config: dict, workloads: list[Workload], rows: list[dict], decode: dict | None,
             prefill: dict | None, *, wall_s: float,
             cpu_before: tuple[float, float] | None = None) -> dict:
    """The JSON document: config, machine, workload stats, runs, probes, ratios and targets."""
    rat = ratios(rows)
    return {"config": config,
            "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                        "torch": torch.__version__, "platform": platform.platform(),
                        "other_cpu_cores": other_cpu_cores(cpu_before, wall_s),
                        "gpu": (torch.cuda.get_device_name()
                                if config.get("device", "cpu").startswith("cuda") else None)},
            "workloads": {w.name: w.stats() for w in workloads}, "runs": rows,
            "decode_probe": decode, "prefill_probe": prefill, "ratios": rat,
            "ratios_per_cpu_s": ratios(rows, "output_tokens_per_cpu_s"),
            "targets": targets(rows, rat, decode, prefill), "wall_s": wall_s}


def _fmt(v, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}{spec}}"


def print_progress(row: dict) -> None:
    print(f"[bench] {row['workload']}/{row['system']}: {row['output_tokens']} output tokens in "
          f"{row['elapsed_s']:.1f}s ({row['output_tokens_per_s']:.1f} tok/s, "
          f"{row['cpu_s']:.0f} CPU-s)", flush=True)


def print_table(rows: list[dict]) -> None:
    head = (f"{'workload':<8} {'system':<10} {'reqs':>4} {'out tok/s':>9} {'tot tok/s':>9} "
            f"{'req/s':>6} {'tok/CPU-s':>9} {'batch':>5} {'KV use':>6} {'KV waste':>8} "
            f"{'pfx hit':>7} {'preempt':>7}  "
            + " ".join(f"{p[:7]:>7}" for p in STEP_PHASES) + "  (% of step time)")
    print(head)
    for r in rows:
        split = r["step_split_pct"] or {}
        pct = lambda v, s=".1%": _fmt(v, s, 6)  # noqa: E731
        print(f"{r['workload']:<8} {r['system']:<10} {r['num_requests']:>4} "
              f"{r['output_tokens_per_s']:>9.1f} {r['total_tokens_per_s']:>9.1f} {r['requests_per_s']:>6.3f} "
              f"{_fmt(r.get('output_tokens_per_cpu_s'), '.1f', 9)} "
              f"{_fmt(r['mean_batch_size'], '.1f', 5)} {pct(r['kv_usage'])} {_fmt(r['kv_waste'], '.2%', 8)} "
              f"{_fmt(r['prefix_cache_hit_rate'], '.1%', 7)} {_fmt(r['num_preemptions'], 'd', 7)}  "
              + " ".join(_fmt(split.get(p), ".1f", 7) for p in STEP_PHASES))


def print_all(results: dict) -> None:
    """The table, the decode and prefill probes, ratios and PASS/FAIL targets."""
    print()
    for name, w in results["workloads"].items():
        out = (f"output median {w['output_median']:.0f} (max {w['output_max']})"
               if w.get("exact_output") else f"to EOS, output cap {w['output_max']}")
        print(f"{name}: {w['num_requests']} requests, prompt median {w['prompt_median']:.0f} (max "
              f"{w['prompt_max']}), {out} tokens")
    print_table(results["runs"])
    d, p = results["decode_probe"], results["prefill_probe"]
    if d:
        split = ", ".join(f"{k} {v:.1f}%" for k, v in d["step_split_pct"].items())
        print(f"\ndecode probe: batch {d['batch_size']} (mean {d['mean_batch_size']:.1f}), "
              f"{d['mean_step_ms']:.0f} ms/step, {d['output_tokens_per_s']:.1f} tok/s; {split}")
    if p:
        hf = f", transformers forward {p['hf_forward_s']:.2f}s ({p['hf_tokens_per_s']:.0f} tok/s)" \
            if p["hf_forward_s"] else ""
        print(f"prefill probe: {p['prompt_tokens']} tokens in {p['engine_s']:.2f}s "
              f"({p['engine_tokens_per_s']:.0f} tok/s){hf}")
    for name, key in (("output tok/s", "ratios"), ("output tokens per CPU-s", "ratios_per_cpu_s")):
        print(f"ratios ({name}): " + ", ".join(
            f"{k} {v:.2f}x" for k, v in results[key].items() if v is not None))
    print("\ntargets:")
    for t in results["targets"]:
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[t["passed"]]
        print(f"  [{mark}] {t['description']}: {_fmt(t['value'], '.4g', 0).strip()} "
              f"(target {t['comparison']} {t['threshold']})")
    m = results["machine"]
    print(f"\nwall time {results['wall_s']:.0f}s on {m['cpu_count']} CPUs, {m['torch_threads']} "
          f"torch threads; other work used {_fmt(m['other_cpu_cores'], '.2f', 0).strip()} cores "
          f"on average (/proc/stat)" + (f"; engine and transformers on {m['gpu']} in "
                                         f"{results['config']['dtype']}" if m.get("gpu") else ""))
    if cpu_shared(m):
        print("WARNING: the CPU was shared with other work: timings are low and noisy. With more "
              "torch threads than free cores OpenMP barriers stall on descheduled threads; "
              "prefer --threads 1 or OMP_WAIT_POLICY=PASSIVE on a busy machine.")
