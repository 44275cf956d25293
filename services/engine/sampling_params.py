"""Per-request generation options, validated at the edge (field names follow OpenAI's API)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SamplingParams(BaseModel):
    """How to pick each next token and when to stop.

    Validation raises ``pydantic.ValidationError`` (a ``ValueError``) whose message names the
    field; the services turn it into INVALID_ARGUMENT / HTTP 400.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(default=256, gt=0)  # output tokens, first token included
    min_tokens: int = Field(default=0, ge=0)  # EOS and stop tokens cannot end it earlier
    temperature: float = Field(default=1.0, ge=0.0)  # 0 means greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)  # nucleus mass kept
    top_k: int = Field(default=0, ge=0)  # 0 disables top-k
    seed: int | None = None  # per-request generator: same seed, same tokens, whatever the batch
    stop_token_ids: tuple[int, ...] = ()  # finish (token kept) when one of these is sampled
    ignore_eos: bool = False  # keep going past EOS (benchmarks with exact output lengths)

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v < 2**63:
            raise ValueError("seed must be in [0, 2**63)")
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
