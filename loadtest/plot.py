"""PNG figures of ``bench serve`` results, and ``python -m loadtest.plot A.json B.json ... --out
DIR`` (``tandem bench plot``) to overlay several runs.

- ``latency_cdf.png``: empirical CDFs of TTFT, TPOT, ITL and E2EL (ms), one line per run (needs
  the per-request arrays that ``--save-detailed`` keeps, or records in memory).
- ``timeline.png``: one row per request: scheduled arrival, sent, first token, finish (s).
- ``throughput.png``: output tokens/s over the run in 1-second bins.
- ``rate_curves.png``: request throughput, goodput, output throughput and SLO attainment vs
  request rate (or max concurrency), one line per label (runs of one label form a curve).
"""
from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from loadtest.metrics import RequestRecord  # noqa: E402

CDF_METRICS = (("ttfts", "TTFT"), ("tpots", "TPOT"), ("itls", "ITL"), ("e2els", "E2E latency"))


def _flat(name: str, values: list) -> np.ndarray:
    if name == "itls":
        values = [x for per_request in values for x in per_request]
    return np.sort(np.asarray([v for v in values if v is not None], dtype=np.float64)) * 1000.0


def latency_cdfs(runs: Sequence[tuple[str, dict]], path: Path) -> None:
    """Overlay the CDFs of ``runs`` (label, detail arrays as ``detail_arrays`` returns)."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, CDF_METRICS):
        for label, detail in runs:
            values = _flat(key, detail.get(key, []))
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=label)
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests" if key != "itls" else "fraction of gaps")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def timeline(records: list[RequestRecord], path: Path) -> None:
    """Per request: scheduled arrival (grey), waiting for first token (orange), streaming
    (blue), failed requests in red."""
    fig, ax = plt.subplots(figsize=(10, max(3.0, min(12.0, 0.08 * len(records) + 2))))
    for r in records:
        y = r.index
        ax.plot([r.scheduled_s], [y], marker="|", color="grey")
        if not r.success:
            ax.plot([r.sent_s, r.finish_s], [y, y], color="red", lw=2)
            continue
        ax.plot([r.sent_s, r.first_token_s], [y, y], color="tab:orange", lw=2)
        ax.plot([r.first_token_s, r.finish_s], [y, y], color="tab:blue", lw=2)
    ax.set(xlabel="seconds since start", ylabel="request",
           title="arrival | waiting for first token (orange) | streaming (blue) | failed (red)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def throughput_timeline(records: list[RequestRecord], duration_s: float, path: Path) -> None:
    """Output tokens per second in 1-second bins; a request's tokens are spread evenly over
    its streamed messages (first token + ITL gaps)."""
    bins = np.zeros(max(1, math.ceil(duration_s)))
    for r in (r for r in records if r.success):
        stamps = r.first_token_s + np.concatenate([[0.0], np.cumsum(r.itl)])
        np.add.at(bins, np.minimum(stamps.astype(int), bins.size - 1), r.output_tokens / stamps.size)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(np.arange(bins.size) + 0.5, bins, width=1.0)
    ax.set(xlabel="seconds since start", ylabel="output tokens/s", title="output throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rate_curves(curves: dict[str, list[dict]], path: Path, x_field: str = "request_rate") -> None:
    """Throughput, goodput and SLO attainment vs ``x_field`` of each result, one line per label."""
    panels = (("request_throughput", "requests/s"), ("request_goodput", "good requests/s"),
              ("output_throughput", "output tokens/s"), ("slo_attainment", "SLO attainment"))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for label, results in curves.items():
        points = sorted(((float(r[x_field]), r) for r in results if r.get(x_field) is not None),
                        key=lambda point: point[0])
        points = [(x, r) for x, r in points if math.isfinite(x)]
        xs = [x for x, _ in points]
        for ax, (key, ylabel) in zip(axes.flat, panels):
            ax.plot(xs, [r.get(key, float("nan")) for _, r in points], marker="o", label=label)
            ax.set(xlabel=x_field.replace("_", " "), ylabel=ylabel)
            ax.grid(alpha=0.3)
    if x_field == "request_rate":  # what was offered: a server keeping up sits on this line
        xs = [float(r[x_field]) for rs in curves.values() for r in rs
              if r.get(x_field) is not None and math.isfinite(float(r[x_field]))]
        if xs:
            axes.flat[0].plot([0, max(xs)], [0, max(xs)], color="grey", ls="--", lw=1, label="offered")
    axes.flat[3].axhline(0.9, color="grey", ls="--", lw=1)
    axes.flat[3].set_ylim(-0.02, 1.05)
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Overlay bench serve results: latency CDFs (needs "
                                "--save-detailed runs) and throughput/goodput vs request rate.")
    p.add_argument("results", nargs="+", help="result JSON files of bench serve")
    p.add_argument("--out", required=True, help="folder for the PNG files")
    p.add_argument("--labels", default="", help="comma-separated, one per file (default: the "
                   "file's 'label' field, else its name)")
    p.add_argument("--x", default="request_rate", choices=["request_rate", "max_concurrency"])
    args = p.parse_args(argv)
    labels = [s for s in args.labels.split(",") if s]
    if labels and len(labels) != len(args.results):
        p.error(f"--labels: {len(labels)} labels for {len(args.results)} files")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs, curves = [], {}
    for i, name in enumerate(args.results):
        result = json.loads(Path(name).read_text())
        label = labels[i] if labels else result.get("label") or Path(name).stem
        curves.setdefault(label, []).append(result)
        if "ttfts" in result:
            runs.append((f"{label} @ {result.get('request_rate')}", result))
    if runs:
        latency_cdfs(runs, out / "latency_cdf.png")
    rate_curves(curves, out / "rate_curves.png", args.x)
    print(f"wrote {out}/rate_curves.png" + (f" and {out}/latency_cdf.png" if runs else
                                            " (no --save-detailed run: no latency CDFs)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
