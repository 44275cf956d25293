"""What a step costs, learned from the steps an engine runs: ``seconds ~ base + per_token * tokens``
with ``tokens`` the step's scheduled tokens (decode rows and prompt tokens alike).

Three uses:
- time-budgeted steps (``engine.max_step_ms``): a step that carries running streams (decode
  rows) computes at most as many prompt tokens as fit the budget, so a stream's inter-token gap
  stays under it while prompts are prefilled beside it (Sarathi-Serve, Agrawal et al., OSDI
  2024, section 4: chunk sizes picked so a hybrid batch meets the TPOT target; they profile
  offline, we fit online);
- conditional disaggregation: a worker reports ``per_token`` (seconds per prompt token) in its
  heartbeat, and the gateway compares the prefill queue's wait with computing a prompt on the
  decode worker itself;
- the KV handoff: the gateway fits each (prefill, decode) pair's handoff seconds to the blocks
  handed over (``tokens`` are blocks there), for the same comparison.

The fit is least squares over the steps seen, each older step's weight multiplied by
``FORGET`` at every new one (about the last 200 steps count), so the model follows a machine
whose load changes (shared cores). Until it has seen steps of different sizes it knows
nothing and caps nothing. One thread only (the engine's, or the gateway's event loop).
"""
from __future__ import annotations

FORGET = 0.995  # weight of the past per observed step
MIN_SPREAD = 4.0  # tokens: the steps seen must differ at least this much (std dev) to fit a slope


class StepCostModel:
    """Online least-squares fit of step seconds against scheduled tokens."""

    def __init__(self) -> None:
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of ``num_tokens`` scheduled tokens took ``seconds``."""
        f = FORGET
        self._w = self._w * f + 1.0
        self._x = self._x * f + num_tokens
        self._xx = self._xx * f + num_tokens * num_tokens
        self._y = self._y * f + seconds
        self._xy = self._xy * f + num_tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """``(base seconds, seconds per token)``, or None while the steps seen cannot tell them
        apart (too few, all of one size, or a slope that is not positive)."""
        if self._w < 2.0:
            return None
        mean_x = self._x / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < MIN_SPREAD * MIN_SPREAD:
            return None
        per_token = (self._xy / self._w - mean_x * self._y / self._w) / var_x
        if per_token <= 0.0:
            return None
        return max(0.0, self._y / self._w - per_token * mean_x), per_token

    def expected_seconds(self, num_tokens: int) -> float:
        """What ``num_tokens`` would take: ``base + per_token * num_tokens`` once fitted; before,
        the (weighted) mean of the times seen, whatever their sizes (0.0 when none was)."""
        fit = self.fit()
        if fit is not None:
            return fit[0] + fit[1] * num_tokens
        return self._y / self._w if self._w else 0.0

    @property
    def seconds_per_token(self) -> float:
        """Seconds one more scheduled token adds to a step (0.0: not known yet)."""
        fit = self.fit()
        return fit[1] if fit else 0.0

    def token_budget(self, max_step_s: float) -> int | None:
        """Most tokens a step may schedule to take at most ``max_step_s`` seconds (at least 1),
        or None when the model does not know yet."""
        fit = self.fit()
        if fit is None:
            return None
        base, per_token = fit
        return max(1, int((max_step_s - base) / per_token))
