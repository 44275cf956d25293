"""Per-request records and the figures of a run, under the field names ``vllm bench serve``
writes, so result files of Tandem and of a peer can be diffed.

Definitions (times in seconds inside, milliseconds in the report):
- TTFT: request sent -> first streamed token. E2EL: request sent -> last token.
- ITL: gaps between consecutive streamed token messages of one request.
- TPOT of a request: ``(e2el - ttft) / (output_tokens - 1)``; requests with one output token
  have none (for goodput their TPOT counts as 0, as vLLM does).
- Goodput (DistServe, Zhong et al. 2024, section 2.2): completed requests that meet every SLO
  given, per second of the run. SLO attainment: those requests over all sent (failed ones
  never meet an SLO).
- Percentiles: numpy's linear interpolation (as vLLM); ``std`` is the population std.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds on the run's clock (0 = start)."""

    index: int
    kind: str
    request_id: str = ""
    scheduled_s: float = 0.0       # when the arrival schedule wanted it sent
    sent_s: float = 0.0            # when it was sent (later when a concurrency cap held it)
    first_token_s: float = 0.0     # 0 when no token arrived
    finish_s: float = 0.0
    prompt_len: int = 0            # tokens; the server's usage when it reported one
    output_tokens: int = 0         # tokens; the server's usage when it reported one
    cached_tokens: int = 0         # prompt tokens the server found in its prefix cache (usage)
    itl: list[float] = field(default_factory=list)  # seconds
    success: bool = False
    error: str = ""
    finish_reason: str = ""

    @property
    def ttft(self) -> float:
        return self.first_token_s - self.sent_s

    @property
    def e2el(self) -> float:
        return self.finish_s - self.sent_s

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:100"]`` -> ``{"ttft": 500.0, "tpot": 100.0}`` (milliseconds).

    Raises:
        ValueError: naming ``goodput`` and the bad item (unknown metric, not ``NAME:MS``, or a
            value that is not a positive number).
    """
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput: {item!r} must be NAME:MS with NAME one of "
                             f"{', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput: {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"goodput: {item!r}: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO in ``slos`` (milliseconds)."""
    if not record.success:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all(values[name] * 1000.0 <= limit for name, limit in slos.items())


def distribution(values_s: list[float], percentiles: list[float], name: str) -> dict[str, float]:
    """``mean_/median_/std_/pXX_{name}_ms`` of ``values_s`` (seconds); zeros when empty."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    if arr.size == 0:
        arr = np.zeros(1)
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def latency_values(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Seconds per metric over the successful ``records`` (ITL: every gap of every request)."""
    done = [r for r in records if r.success]
    return {"ttft": [r.ttft for r in done],
            "tpot": [t for r in done if (t := r.tpot) is not None],
            "itl": [x for r in done for x in r.itl],
            "e2el": [r.e2el for r in done]}


def max_concurrency_seen(records: list[RequestRecord]) -> int:
    """The most requests in flight at once (sent, not yet finished)."""
    events = sorted([(r.sent_s, 1) for r in records] + [(r.finish_s, -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def summarize(records: list[RequestRecord], duration_s: float, slos: dict[str, float],
              percentiles: list[float]) -> dict:
    """The run's figures (vLLM's field names; see the module doc). ``duration_s`` > 0 is the
    wall time from the first send to the last finish."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration_s}")
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = sum(meets_slos(r, slos) for r in records) if slos else len(done)
    result = {
        "duration": duration_s, "completed": len(done), "failed": len(records) - len(done),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "total_cached_tokens": (cached := sum(r.cached_tokens for r in done)),
        "prefix_cache_hit_rate": cached / input_tokens if input_tokens else 0.0,
        "request_throughput": len(done) / duration_s,
        "request_goodput": good / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "slo_attainment": good / len(records) if records else 0.0,
        "goodput_slos_ms": slos, "max_concurrent_requests": max_concurrency_seen(records),
    }
    values = latency_values(records)
    for name in LATENCY_METRICS:
        result.update(distribution(values[name], percentiles, name))
    result["errors_by_message"] = _error_counts(records)
    return result


def _error_counts(records: list[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.success:
            counts[r.error] = counts.get(r.error, 0) + 1
    return counts


def by_kind(records: list[RequestRecord], duration_s: float, slos: dict[str, float],
            percentiles: list[float]) -> dict[str, dict]:
    """``summarize`` per request kind (e.g. ``chat`` vs ``long`` of ``long-mix``)."""
    kinds = sorted({r.kind for r in records})
    return {k: summarize([r for r in records if r.kind == k], duration_s, slos, percentiles)
            for k in kinds}


def detail_arrays(records: list[RequestRecord]) -> dict[str, list]:
    """Per-request arrays (seconds) of the successful records, under vLLM's detailed names
    (``ttfts``, ``itls``) plus ``tpots`` and ``e2els``; ``itls`` is one list per request."""
    done = [r for r in records if r.success]
    return {"ttfts": [r.ttft for r in done], "tpots": [r.tpot for r in done],
            "itls": [r.itl for r in done], "e2els": [r.e2el for r in done]}
