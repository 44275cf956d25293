"""Engine types <-> internal proto messages, shared by the gateway and the workers.

Torch-free on purpose: the gateway converts sampling settings without importing the worker
runtime, the engine or the model (``TokenLogprobs`` is only a type here).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from services.api import worker_pb2
from services.engine.sampling_params import SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from services.engine.sampler import TokenLogprobs

_SHARED_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                  "num_prior_output_tokens")


def params_from_proto(p: worker_pb2.SamplingParams) -> SamplingParams:
    """Internal proto -> SamplingParams (stop strings stay with the gateway, which owns text).

    Raises pydantic.ValidationError (a ValueError naming the field) on values out of range."""
    so = p.structured_output if p.HasField("structured_output") else None
    return SamplingParams(
        **{name: getattr(p, name) for name in _SHARED_FIELDS},
        seed=p.seed if p.HasField("seed") else None, stop_token_ids=tuple(p.stop_token_ids),
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        structured_output=StructuredOutput(format=so.format, spec=so.spec) if so else None,
        logit_bias=tuple(sorted(p.logit_bias.items())),
    )


def params_to_proto(p: SamplingParams) -> worker_pb2.SamplingParams:
    """SamplingParams -> internal proto (``stop`` strings are not sent: the gateway owns text)."""
    so = p.structured_output
    return worker_pb2.SamplingParams(
        **{name: getattr(p, name) for name in _SHARED_FIELDS},
        seed=p.seed, stop_token_ids=list(p.stop_token_ids), logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        structured_output=worker_pb2.StructuredOutput(format=so.format, spec=so.spec) if so else None,
        logit_bias=dict(p.logit_bias),
    )


def logprobs_to_proto(lp: TokenLogprobs) -> worker_pb2.SampledLogprobs:
    """One sampled token's logprob and its top alternatives as the internal proto."""
    ids, lps = zip(*lp.top) if lp.top else ((), ())
    return worker_pb2.SampledLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                                      top_token_ids=ids, top_logprobs=lps)
