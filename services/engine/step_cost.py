"""What a step costs, learned from the steps an engine runs: ``seconds ~ base + per_token * tokens``
with ``tokens`` the step's scheduled tokens (decode rows and prompt tokens alike).

Three uses:
- time-budgeted steps (``engine.max_step_ms``): a step that carries running streams (decode
  rows) computes at most as many prompt tokens as fit the budget, so a stream's inter-token gap
  stays under it while prompts are prefilled beside it (Sarathi-Serve, Agrawal et al., OSDI
  2024, section 4: chunk sizes picked so a hybrid batch meets the TPOT target; they profile
  offline, we fit online), by ``PromptCostModel`` (rows and prompt tokens apart) once it
  knows, by this fit until then;
- conditional disaggregation: a worker reports what one more prompt token costs a step in its
  heartbeat (``PromptCostModel``: decode rows and prompt tokens fitted apart, since a decode
  row costs a step far more than a prompt token does on a GPU, and differently on a CPU), and
  the gateway compares the prefill queue's wait with computing a prompt on the decode worker
  itself;
- the KV handoff: the gateway fits each (prefill, decode) pair's handoff seconds to the blocks
  handed over (``tokens`` are blocks there), for the same comparison; it forgets by the
  seconds between handoffs rather than per handoff (``observe``'s ``forget``).

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

    def observe(self, num_tokens: int, seconds: float, forget: float = FORGET) -> None:
        """A step of ``num_tokens`` scheduled tokens took ``seconds``; what was seen before
        counts ``forget`` times as much as it did (in [0, 1])."""
        f = forget
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
    def weight(self) -> float:
        """How many observations the model holds, each counted at its forgotten weight."""
        return self._w

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


class PromptCostModel:
    """Online least-squares fit of step seconds against a step's decode rows and prompt tokens
    apart, ``seconds ~ base + per_row * rows + per_prompt_token * prompt_tokens``, with
    ``StepCostModel``'s forgetting; for ``seconds_per_prompt_token``, what computing a prompt
    costs a worker.

    Why apart: a decode worker's steps are mostly decode rows, and one row costs a step more
    than one prompt token (each row reads its own KV; on a GPU a step of decode rows is bound
    by reading the weights, whatever its rows). Fitted over all scheduled tokens alike, such a
    worker reported mostly its decode rows' cost as its prompt tokens' (the unit test's
    decode worker: 0.89 ms a token for prompt tokens of 0.5 ms beside rows of 2 ms). Without
    prompt tokens of different counts, or with prompt tokens that only ever vary with the
    rows, the prompt's cost is unknown (0.0), not guessed.

    ``observe`` runs on the engine thread; ``seconds_per_prompt_token`` may be read from
    another (the heartbeat): it reads floats, at worst from steps a moment apart."""

    def __init__(self) -> None:
        # weighted sums: 1, r, p, rr, pp, rp, y, ry, py
        self._s = [0.0] * 9

    def observe(self, num_decode_rows: int, num_prompt_tokens: int, seconds: float) -> None:
        """A step of ``num_decode_rows`` decode rows and ``num_prompt_tokens`` prompt tokens took
        ``seconds``."""
        r, p, y = num_decode_rows, num_prompt_tokens, seconds
        f, s = FORGET, self._s
        for i, v in enumerate((1.0, r, p, r * r, p * p, r * p, y, r * y, p * y)):
            s[i] = s[i] * f + v

    def fit(self) -> tuple[float, float, float] | None:
        """``(base seconds, seconds per decode row, seconds per prompt token)``, or None while
        the prompt tokens' cost cannot be told (too few steps, prompt tokens of one count or
        tied to the rows, or a slope that is not positive). Rows that never varied (a prefill
        worker's: none) get 0 a row, their cost inside the base; a row slope under 0 (noise)
        is taken as 0."""
        w, r, p, rr, pp, rp, y, ry, py = self._s
        if w < 2.0:
            return None
        # centred (co)variances
        var_r, var_p = rr / w - (r / w) ** 2, pp / w - (p / w) ** 2
        cov_rp, cov_ry = rp / w - r * p / w / w, ry / w - r * y / w / w
        cov_py = py / w - p * y / w / w
        if var_r < 1e-9:  # rows never vary: prompt tokens alone
            spread, per_prompt, per_row = var_p, (cov_py / var_p if var_p > 0 else 0.0), 0.0
        else:  # the prompt tokens' variance left once the rows explain what they can
            spread = var_p - cov_rp * cov_rp / var_r
            det = var_r * var_p - cov_rp * cov_rp
            if det <= 0:
                return None
            per_prompt = (var_r * cov_py - cov_rp * cov_ry) / det
            per_row = max(0.0, (var_p * cov_ry - cov_rp * cov_py) / det)
        if spread < MIN_SPREAD * MIN_SPREAD or per_prompt <= 0.0:
            return None
        return max(0.0, (y - per_row * r - per_prompt * p) / w), per_row, per_prompt

    @property
    def seconds_per_prompt_token(self) -> float:
        """Seconds one more prompt token adds to a step, decode rows held equal (0.0: not known,
        see ``fit``)."""
        fit = self.fit()
        return fit[2] if fit else 0.0

    def token_budget(self, max_step_s: float) -> tuple[int, float] | None:
        """For steps of at most ``max_step_s`` seconds: ``(prompt tokens a step without decode
        rows may compute (at least 1), what each decode row takes of that, in prompt
        tokens)``, or None while the fit is unknown. A step of R rows may then compute
        ``budget - R x row_tokens`` prompt tokens. A budget that counts rows and prompt tokens
        alike (``StepCostModel.token_budget``) misjudges both wherever they cost a step
        differently (a row reads its own KV; on a GPU a step of rows is bound by reading the
        weights)."""
        fit = self.fit()
        if fit is None:
            return None
        base, per_row, per_prompt = fit
        return max(1, int((max_step_s - base) / per_prompt)), per_row / per_prompt
