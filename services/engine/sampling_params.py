"""Per-request generation options, validated at the edge (field names follow OpenAI's API)."""
from __future__ import annotations

# below this temperature a request samples greedily (vLLM's _SAMPLING_EPS): dividing logits by
# a tiny temperature overflows them to inf, and the softmax of inf is nan
SAMPLING_EPS = 1e-5

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.errors import InvalidArgument


class StructuredOutput(BaseModel):
    """A constraint on the whole output (vLLM's ``structured_outputs``, OpenAI's
    ``response_format``): ``format`` ``json`` (``spec``: a JSON schema; ``{"type": "object"}``
    for any object), ``regex`` (Rust regex syntax), ``choice`` (a JSON list of strings) or
    ``grammar`` (Lark, or llama.cpp's GBNF). Compiled and checked by ``grammars.grammar_of``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["json", "regex", "choice", "grammar"]
    spec: str


class SamplingParams(BaseModel):
    """How to pick each next token and when to stop.

    Validation raises ``pydantic.ValidationError`` (a ``ValueError``) whose message names the
    field; the services turn it into INVALID_ARGUMENT / HTTP 400. Every float must be finite
    (inf and nan are refused, naming the field). Token ids are checked against the model by the
    engine (``LLMEngine.check_params``). A temperature below ``SAMPLING_EPS`` means greedy.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    max_tokens: int = Field(default=256, ge=0)  # output tokens, first token included; 0: score
    # the prompt only (needs prompt_logprobs)
    min_tokens: int = Field(default=0, ge=0)  # EOS and stop tokens cannot end it earlier
    temperature: float = Field(default=1.0, ge=0.0)  # below SAMPLING_EPS: greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)  # nucleus mass kept
    top_k: int = Field(default=0, ge=0)  # 0 disables top-k
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # drop tokens below min_p x top prob
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)  # OpenAI: once per seen token
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)  # OpenAI: per occurrence
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)  # CTRL: prompt + output
    seed: int | None = None  # same seed, same tokens, whatever the batch (sampler.uniforms)
    stop: tuple[str, ...] = ()  # finish when the text contains one; it is not emitted
    stop_token_ids: tuple[int, ...] = ()  # finish (token kept) when one of these is sampled
    ignore_eos: bool = False  # keep going past EOS (benchmarks with exact output lengths)
    logprobs: int | None = Field(default=None, ge=0, le=20)  # top-N alternatives; 0: chosen only
    # a resumed request (migration): the prompt's last N tokens are output tokens of an earlier
    # attempt, so the seed's draws and the frequency/presence penalties continue after them
    num_prior_output_tokens: int = Field(default=0, ge=0)
    structured_output: StructuredOutput | None = None  # every output token keeps it valid
    # (token id, bias) added to the logits before sampling (OpenAI's logit_bias: -100 bans a
    # token, 100 all but forces it); ids are checked against the model by the engine
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's prompt_logprobs: each prompt token's logprob (after the first) and the top-N
    # alternatives at its position; prefix-cache hits are not used for such a request
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v < 2**63:
            raise ValueError("seed must be in [0, 2**63)")
        return v

    @field_validator("structured_output")
    @classmethod
    def _compiles(cls, v: StructuredOutput | None) -> StructuredOutput | None:
        if v is not None:
            from .grammars import grammar_of

            grammar_of(v.format, v.spec)  # ValueError naming structured_output and why
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        ids = [token for token, _ in v]
        if any(token < 0 for token in ids) or len(set(ids)) != len(ids):
            raise ValueError("logit_bias: token ids must be distinct and >= 0")
        if any(not -100.0 <= bias <= 100.0 for _, bias in v):
            raise ValueError("logit_bias: biases must be within [-100, 100]")
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise InvalidArgument("max_tokens", "must be > 0 unless prompt_logprobs are asked for "
                                  "(scoring a prompt)")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
