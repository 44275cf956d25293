"""Migration and retry arithmetic of the token stream (``dispatch.py``): a request resumed on
another worker after ``num_generated`` tokens asks only for the rest, and tokens the client
already has are dropped from what the new worker sends."""
from __future__ import annotations

from services.api import worker_pb2


def resumed_params(params: worker_pb2.SamplingParams, num_generated: int) -> worker_pb2.SamplingParams:
    """The sampling settings for the rest of a request that has ``num_generated`` tokens."""
    if not num_generated:
        return params
    resumed = worker_pb2.SamplingParams()
    resumed.CopyFrom(params)
    resumed.max_tokens = params.max_tokens - num_generated
    resumed.min_tokens = max(params.min_tokens - num_generated, 0)
    resumed.num_prior_output_tokens = params.num_prior_output_tokens + num_generated
    resumed.ClearField("prompt_logprobs")  # delivered with the first token, by the first attempt
    return resumed


def only_new(msg: worker_pb2.DecodeResponse, base: int, num_sent: int) -> worker_pb2.DecodeResponse:
    """Drop tokens the client already has. ``msg.num_output_tokens`` counts the attempt's
    tokens; the attempt started after ``base`` tokens; ``num_sent`` were sent so far."""
    first = base + msg.num_output_tokens - len(msg.token_ids)  # position of msg.token_ids[0]
    if first > num_sent:
        raise RuntimeError(f"token stream gap: next token is #{num_sent}, the worker sent #{first}")
    skip = num_sent - first
    if not skip and not base:  # the first attempt, nothing resent: the message as it came
        return msg
    return worker_pb2.DecodeResponse(
        token_ids=msg.token_ids[skip:], finish_reason=msg.finish_reason,
        num_output_tokens=base + msg.num_output_tokens, logprobs=msg.logprobs[skip:],
        num_cached_tokens=msg.num_cached_tokens, prompt_logprobs=msg.prompt_logprobs)
