"""The one mapping of errors to what clients see (``services.errors``): each typed error's gRPC
status code (through the gRPC interceptor) and HTTP status with OpenAI's error body (through the
HTTP front end), ``param`` naming the field it was raised with, never read from the message."""
from __future__ import annotations

import asyncio
import copy
import json
import pickle

import grpc
import pydantic
import pytest

from services.api import worker_pb2, worker_pb2_grpc
from services.engine.sampling_params import SamplingParams
from services.errors import (CONTEXT_LENGTH_EXCEEDED, Aborted, BodyTooLarge, InvalidArgument,
                             NotJson, RequestFailed, ResourceExhausted, Unavailable, error_status,
                             from_validation)
from services.gateway import validation
from services.gateway.http import _error_response, _prompt_field
from services.gateway.limits import RateLimited
from services.rpc import _abort, create_server, invalid_argument

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name


class AbortRecorder:
    """The part of ``grpc.aio.ServicerContext`` the interceptor uses."""

    def set_trailing_metadata(self, metadata) -> None:
        self.metadata = metadata

    async def abort(self, code, details):
        self.code, self.details = code, details


def grpc_answer(exc: Exception) -> tuple[grpc.StatusCode, str]:
    context = AbortRecorder()
    asyncio.run(_abort(context, exc, "/tandem.v1.Gateway/Generate"))
    return context.code, context.details


def http_answer(exc: Exception) -> tuple[int, dict, dict]:
    response = _error_response(exc, {"X-Request-Id": "r1"})
    return response.status_code, json.loads(response.body)["error"], dict(response.headers)


def sampling_error(**fields) -> pydantic.ValidationError:
    with pytest.raises(pydantic.ValidationError) as info:
        SamplingParams(**fields)
    return info.value


CASES = [  # exception, gRPC code, HTTP status, OpenAI type, param, code, message
    (InvalidArgument("temperature", "must be >= 0"), grpc.StatusCode.INVALID_ARGUMENT, 400,
     "invalid_request_error", "temperature", None, "temperature: must be >= 0"),
    (InvalidArgument("messages", "9000 tokens do not fit", CONTEXT_LENGTH_EXCEEDED),
     grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", "messages",
     "context_length_exceeded", "messages: 9000 tokens do not fit"),
    (BodyTooLarge("request", "5 bytes exceed the gateway's limit"), grpc.StatusCode.INVALID_ARGUMENT,
     413, "invalid_request_error", "request", None, "request: 5 bytes exceed the gateway's limit"),
    (NotJson("request body: declared as 'text/plain'"), grpc.StatusCode.INVALID_ARGUMENT, 415,
     "invalid_request_error", None, None, "request body: declared as 'text/plain'"),
    (ValueError("prompt, messages: give exactly one of them"), grpc.StatusCode.INVALID_ARGUMENT,
     400, "invalid_request_error", None, None, "prompt, messages: give exactly one of them"),
    (ResourceExhausted("no KV blocks"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429,
     "rate_limit_error", None, None, "no KV blocks"),
    (RateLimited("key k1: over requests_per_minute", 4), grpc.StatusCode.RESOURCE_EXHAUSTED, 429,
     "rate_limit_error", None, "rate_limit_exceeded", "key k1: over requests_per_minute"),
    (Unavailable("no decode worker"), grpc.StatusCode.UNAVAILABLE, 503, "server_error", None,
     None, "no decode worker"),
    (Aborted("the request was aborted"), grpc.StatusCode.ABORTED, 503, "server_error", None,
     None, "the request was aborted"),
    (RequestFailed("request r1 failed in the engine: boom"), grpc.StatusCode.INTERNAL, 500,
     "server_error", None, None, "request r1 failed in the engine: boom"),
    (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error", None, None,
     "timed out"),
    (RuntimeError("secret internals"), grpc.StatusCode.INTERNAL, 500, "server_error", None, None,
     "internal error (RuntimeError)"),
]


@pytest.mark.parametrize("exc,grpc_code,status,kind,param,code,message", CASES,
                         ids=[type(c[0]).__name__ + str(i) for i, c in enumerate(CASES)])
def test_each_error_maps_once_to_grpc_and_to_openai_http(exc, grpc_code, status, kind, param,
                                                         code, message):
    assert grpc_answer(exc) == (grpc_code, message)
    http_status, body, headers = http_answer(exc)
    assert http_status == status
    assert body == {"message": message, "type": kind, "param": param, "code": code}
    assert headers["x-request-id"] == "r1"
    assert ("retry-after" in headers) == (status == 429)


def test_retry_after_is_the_limits_own_wait():
    assert http_answer(RateLimited("over", 7))[2]["retry-after"] == "7"
    assert http_answer(ResourceExhausted("full"))[2]["retry-after"] == "1"


def test_cancelled_is_its_own_code():
    assert error_status(asyncio.CancelledError()).grpc_code == "CANCELLED"


def test_pydantic_errors_name_their_first_field():
    field_error = sampling_error(temperature=-1.0)
    status = error_status(field_error)
    assert (status.grpc_code, status.http_status, status.param) == ("INVALID_ARGUMENT", 400, "temperature")
    assert status.message.startswith("temperature: ")
    # a model-level check names its field with its own InvalidArgument
    model_error = sampling_error(max_tokens=0)
    assert error_status(model_error).param == "max_tokens"
    assert error_status(model_error).message.startswith("max_tokens: must be > 0")
    # one with no field at fault stays a plain ValueError: no param
    assert error_status(sampling_error(max_tokens=2, min_tokens=3)).param is None


def test_from_validation_renames_internal_fields():
    exc = from_validation(sampling_error(logprobs=-1), {"logprobs": "top_logprobs"})
    assert isinstance(exc, InvalidArgument) and exc.param == "top_logprobs"
    assert str(exc).startswith("top_logprobs: ") and "logprobs:" not in exc.reason
    plain = from_validation(sampling_error(max_tokens=2, min_tokens=3))
    assert type(plain) is ValueError and str(plain) == "min_tokens (3) must not exceed max_tokens (2)"


def test_renamed_keeps_the_code_and_the_kind():
    over = InvalidArgument("prompt_token_ids[3]", "too long", CONTEXT_LENGTH_EXCEEDED)
    moved = over.renamed(_prompt_field(over.param, 1))
    assert (moved.param, moved.code, str(moved)) == ("prompt[1][3]", CONTEXT_LENGTH_EXCEEDED,
                                                     "prompt[1][3]: too long")
    assert type(BodyTooLarge("request", "big").renamed("body")) is BodyTooLarge
    assert _prompt_field("prompt", None) == "prompt" and _prompt_field("prompt", 2) == "prompt[2]"
    assert _prompt_field("temperature", 2) == "temperature"


def test_structured_output_errors_carry_the_requests_field():
    with pytest.raises(InvalidArgument) as info:
        validation.check_structured("regex", "(unclosed", "response_format.json_schema.schema")
    assert info.value.param == "response_format.json_schema.schema"
    assert str(info.value).startswith("response_format.json_schema.schema: regex: ")


class FailingDecode(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def GetLoad(self, request, context):
        raise self.exc


async def _over_grpc(exc: Exception) -> Exception:
    """``exc`` raised by a worker's handler, as the gateway's dispatch sees it."""
    server, _ = create_server([SERVICE])
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(FailingDecode(exc), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await worker_pb2_grpc.DecodeWorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest())
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return invalid_argument(info.value.details(), info.value.trailing_metadata())
    finally:
        await server.stop(None)


@pytest.mark.parametrize("exc", [
    InvalidArgument("prompt", "900 tokens exceed this worker's KV cache"),
    InvalidArgument("messages", "too long", CONTEXT_LENGTH_EXCEEDED),
], ids=["field", "field and code"])
def test_a_workers_invalid_argument_keeps_its_field_across_grpc(exc):
    again = asyncio.run(_over_grpc(exc))
    assert type(again) is InvalidArgument
    assert (again.param, again.code, str(again)) == (exc.param, exc.code, str(exc))


def test_a_workers_plain_value_error_stays_plain_across_grpc():
    again = asyncio.run(_over_grpc(ValueError("request 7: unknown KV notification status 'x'")))
    assert type(again) is ValueError and str(again) == "request 7: unknown KV notification status 'x'"


def test_invalid_argument_copies_whole():
    exc = BodyTooLarge("request", "big", "some_code")
    for again in (copy.copy(exc), pickle.loads(pickle.dumps(exc))):
        assert type(again) is BodyTooLarge
        assert (again.param, again.reason, again.code) == ("request", "big", "some_code")
