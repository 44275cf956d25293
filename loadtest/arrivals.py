"""Request arrival schedules: when each request of a run is sent, in seconds from the start.

Gaps between arrivals are gamma-distributed with shape ``burstiness`` and mean ``1 / rate``
(scale ``1 / (rate * burstiness)``), as in vLLM's ``benchmarks/serve.py``: burstiness 1 is a
Poisson process (exponential gaps, coefficient of variation 1); below 1 is burstier (CV =
1 / sqrt(burstiness) > 1); above 1 is more regular. A rate of ``inf`` sends everything at once.

Ramp-up: the rate moves from ``ramp_start_rate`` to ``rate`` over the run, linearly or
exponentially in the request index (vLLM's ``--ramp-up-strategy``), so one run crosses a range
of loads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

RAMPS = ("none", "linear", "exponential")


@dataclass(frozen=True)
class ArrivalSchedule:
    """The load shape of a run.

    rate: requests per second (> 0; ``math.inf`` = all at once).
    burstiness: gamma shape of the gaps (> 0; 1 = Poisson).
    ramp: ``none``, ``linear`` or ``exponential``; with a ramp the rate goes from
        ``ramp_start_rate`` (> 0, requests/s) at the first request to ``rate`` at the last.
    seed: the generator's seed; same fields, same times.
    """

    rate: float
    burstiness: float = 1.0
    ramp: str = "none"
    ramp_start_rate: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness}")
        if self.ramp not in RAMPS:
            raise ValueError(f"ramp must be one of {', '.join(RAMPS)}, got {self.ramp!r}")
        if self.ramp != "none" and not (self.ramp_start_rate > 0 and math.isfinite(self.rate)):
            raise ValueError("ramp_start_rate must be > 0 and request_rate finite for a ramp, "
                             f"got {self.ramp_start_rate} -> {self.rate}")

    def rates(self, n: int) -> np.ndarray:
        """Per-request rate in requests/s, shape ``[n]``, float64."""
        if self.ramp == "none" or n == 1:
            return np.full(n, self.rate, dtype=np.float64)
        progress = np.arange(n, dtype=np.float64) / (n - 1)
        lo, hi = self.ramp_start_rate, self.rate
        if self.ramp == "linear":
            return lo + (hi - lo) * progress
        return lo * (hi / lo) ** progress

    def times(self, n: int) -> np.ndarray:
        """Send times of ``n`` requests, seconds from the start, shape ``[n]``, float64,
        non-decreasing; the first request goes at 0. Spans about ``n / rate`` seconds without a
        ramp.

        Raises:
            ValueError: ``n`` < 1.
        """
        if n < 1:
            raise ValueError(f"num_prompts must be >= 1, got {n}")
        if math.isinf(self.rate):
            return np.zeros(n, dtype=np.float64)
        rng = np.random.default_rng(self.seed)
        rates = self.rates(n)
        gaps = rng.gamma(self.burstiness, 1.0 / (rates * self.burstiness))
        gaps[0] = 0.0  # the run starts with a request, not a wait
        return np.cumsum(gaps)
