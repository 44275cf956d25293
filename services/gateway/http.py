"""OpenAI-compatible HTTP front end (FastAPI, served by uvicorn on the gateway's own event loop):
``POST /v1/chat/completions`` and ``/v1/completions`` (SSE streaming or whole),
``/v1/responses`` (``responses_api.py``), vLLM's ``/tokenize`` and ``/detokenize``
(``tokenize_api.py``), ``GET /v1/models``, ``/health`` (the process answers), ``/ready`` (Redis and a prefill and a decode
worker are live) and ``/metrics`` (Prometheus, ``services/observability/metrics.py``). It
translates formats and errors only; every request goes through the same ``GatewayCore``
pipeline as gRPC.

Errors use OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}`` on every path:
400 bad input (``param`` names the field; a prompt over the context has code
``context_length_exceeded``), 401 no or wrong API key on ``/v1/*`` (``http_auth.py``, before
the body is read), 404 no such path, 405 a method the path does not serve (with ``Allow``), 413
body over ``max_request_bytes`` (refused from Content-Length, or while reading, never read
whole), 415 a body that is declared as something other than JSON, 429 overload or a per-key
limit (``Retry-After``; ``limits.py``), 503 no worker or Redis. An error after a stream
started is an SSE ``data: {"error": ...}`` event, then ``data: [DONE]``; so is a request aborted
before it finished (an Abort call on its id, or the gateway stopping), where gRPC ends with
finish_reason "abort", which OpenAI's API does not have (503 when nothing was streamed yet).

``X-Request-Id`` is honoured, used as the request's id (Redis, logs; ``{id}-{index}`` for each
choice when a request has several: ``n`` > 1 or a completions batch, see ``choices.py``) and
returned on every response. A client gone, from a stream or from a non-streaming request, aborts
the request: every choice's blocks are freed, Redis says ABORTED.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from contextlib import aclosing

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from services.errors import (Aborted, BodyTooLarge, ErrorStatus, InvalidArgument, NotJson,
                             error_status)
from services.gateway.access import Access
from services.gateway.choices import Choices
from services.gateway.health import ReadinessMonitor
from services.gateway.http_auth import ApiKeyMiddleware, request_identity
from services.gateway.openai_api import ChatCompletionRequest, CompletionRequest
from services.gateway.openai_responses import Chunker, error_body
from services.gateway.pipeline import GatewayCore, Prepared
from services.gateway.responses_api import ResponseBuilder, ResponsesRequest
from services.gateway.tokenize_api import DetokenizeRequest, TokenizeRequest
from services.observability import tracing
from services.observability.metrics import render

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before the answer (never sent)


def create_app(core: GatewayCore, readiness: ReadinessMonitor, access: Access | None = None) -> FastAPI:
    """The FastAPI application over ``core``; ``readiness`` answers ``/ready``; ``access``: API
    keys (every ``/v1/*`` route) and per-key limits (default: open, unlimited)."""
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None, openapi_url=None)
    access = access or Access()
    app.add_middleware(ApiKeyMiddleware, access=access)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = bool(readiness.ready)
        return JSONResponse({"ready": ok, "reason": "" if ok else readiness.reason}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:  # Prometheus; like /health, open without an API key
        body, content_type = render(core.metrics.registry)
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        card = core.model
        return {"object": "list", "data": [{"id": card.name, "object": "model", "created": 0,
                                            "owned_by": "tandem", "max_model_len": card.max_model_len}]}

    _add_json_routes(app, {
        "/v1/chat/completions": lambda r: _complete(core, r, ChatCompletionRequest, "chat", access),
        "/v1/completions": lambda r: _complete(core, r, CompletionRequest, "completion", access),
        "/v1/responses": lambda r: _respond(core, r, access),
        "/tokenize": lambda r: _tokenize(core, r),
        "/detokenize": lambda r: _detokenize(core, r),
    })
    return app


def _add_json_routes(app: FastAPI, routes: dict[str, Callable[[Request], Awaitable[Response]]]) -> None:
    """``POST path`` for each route: its handler reads the JSON body itself (``_parse``: size
    cap, Content-Type, schema) and answers every failure in OpenAI's error shape."""
    for path, handle in routes.items():
        app.add_api_route(path, _endpoint(handle), methods=["POST"], name=path)


def _endpoint(handle: Callable[[Request], Awaitable[Response]]):
    async def endpoint(request: Request):
        return await handle(request)
    return endpoint


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """The framework's own errors (404 no such path, 405 wrong method) in OpenAI's shape."""
    message = (f"{request.method} {request.url.path}: no such path" if exc.status_code == 404 else
               f"{request.method} {request.url.path}: method not allowed" if exc.status_code == 405 else
               str(exc.detail))
    return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code,
                        headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    message = "; ".join(f"{_field_path(e['loc'])}: {e['msg']}" for e in errors) or "invalid request"
    param = (_field_path(errors[0]["loc"]) or None) if errors else None
    return JSONResponse(error_body(message, 422, param), status_code=422)


async def _tokenize(core: GatewayCore, request: Request):
    """vLLM's ``/tokenize`` (``tokenize_api.py``)."""
    try:
        body = await _parse(request, TokenizeRequest, core.limits.max_request_bytes)
        ids = await core.tokenize(body.to_proto())
    except Exception as exc:  # noqa: BLE001
        return _error_response(exc, {})
    return body.answer(ids, core.model.max_model_len, core.tokenizer)


async def _detokenize(core: GatewayCore, request: Request):
    """vLLM's ``/detokenize`` (``tokenize_api.py``)."""
    try:
        body = await _parse(request, DetokenizeRequest, core.limits.max_request_bytes)
        return body.answer(core.model, core.tokenizer)
    except Exception as exc:  # noqa: BLE001
        return _error_response(exc, {})


async def _complete(core: GatewayCore, request: Request, body_cls, kind: str, access: Access):
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    headers = {"X-Request-Id": rid}
    identity = request_identity(request)
    try:
        access.check_request(identity)
        body = await _parse(request, body_cls, core.limits.max_request_bytes)
        protos = body.to_protos(rid, core.limits.max_tokens_cap)
        body.check_n(core.limits.max_n, len(protos))
        prompts = await _prepare_all(core, protos, request.headers if tracing.enabled() else None)
        choices = await Choices.admit(core, prompts, body.n, access, identity)
    except Exception as exc:  # noqa: BLE001 — every failure becomes OpenAI's error JSON
        return _error_response(exc, headers)
    chunker = Chunker(kind, rid, core.model.name, body.n, len(prompts),
                      body.presentation(lambda ids: core.tokenizer.decode(ids, skip_special_tokens=False)))
    responses = _unless_aborted(choices.stream())
    if body.stream:  # NOTE: up to the first token, a failure still gets its HTTP status
        try:
            first = await anext(responses)
        except Exception as exc:  # noqa: BLE001
            return _error_response(exc, headers)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(first, responses, chunker, include_usage),
                                 media_type="text/event-stream", headers=headers)
    try:
        by_choice = await _collect_unless_gone(request, responses, len(choices.children))
    except Exception as exc:  # noqa: BLE001
        return _error_response(exc, headers)
    if by_choice is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST, headers=headers)
    return JSONResponse(chunker.whole(by_choice), headers=headers)


async def _respond(core: GatewayCore, request: Request, access: Access):
    """``/v1/responses``: one choice, answered as a ``response`` object or its event stream."""
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    headers = {"X-Request-Id": rid}
    identity = request_identity(request)
    try:
        access.check_request(identity)
        body = await _parse(request, ResponsesRequest, core.limits.max_request_bytes)
        prompts = await _prepare_all(core, [body.to_proto(rid)],
                                     request.headers if tracing.enabled() else None)
        choices = await Choices.admit(core, prompts, 1, access, identity)
    except Exception as exc:  # noqa: BLE001
        return _error_response(exc, headers)
    builder = ResponseBuilder(rid, core.model.name, body)
    responses = _unless_aborted(choices.stream())
    if body.stream:
        try:
            first = await anext(responses)
        except Exception as exc:  # noqa: BLE001
            return _error_response(exc, headers)
        return StreamingResponse(_response_events(first, responses, builder),
                                 media_type="text/event-stream", headers=headers)
    try:
        by_choice = await _collect_unless_gone(request, responses, 1)
    except Exception as exc:  # noqa: BLE001
        return _error_response(exc, headers)
    if by_choice is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST, headers=headers)
    return JSONResponse(builder.whole(by_choice[0]), headers=headers)


async def _response_events(first, responses, builder: ResponseBuilder):
    """The Responses API's stream: ``event: TYPE`` and ``data: {...}`` per event, no [DONE]."""
    try:
        for event in builder.start_events() + builder.delta_events(first[1]):
            yield _named_event(event)
        async with aclosing(responses) as rs:
            async for _, msg in rs:
                for event in builder.delta_events(msg):
                    yield _named_event(event)
    except Exception as exc:  # noqa: BLE001 — the stream has started: an error event
        status = _status(exc)
        yield _named_event({"type": "error", "sequence_number": builder._sequence,
                            "code": status.code, "message": status.message, "param": status.param})


def _named_event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


async def _unless_aborted(responses):
    """``responses`` (index, GenerateResponse) until one ends with finish_reason "abort" (an
    Abort call on its id, or the gateway stopping), which raises Aborted (closing the rest):
    OpenAI's API has no such finish reason, so HTTP answers an error (503)."""
    async with aclosing(responses) as rs:
        async for index, msg in rs:
            if msg.finish_reason == "abort":
                raise Aborted("the request was aborted before it finished (an Abort call "
                              "on its id, or the gateway shutting down)")
            yield index, msg


async def _prepare_all(core: GatewayCore, protos: list, carrier) -> list[Prepared]:
    """``core.prepare`` each prompt of a request, in order. Raises the first failure (naming
    ``prompt[i]`` in a batch); the prompts prepared before it end their spans failed."""
    prepared: list[Prepared] = []
    try:
        for i, proto in enumerate(protos):
            try:
                prepared.append(await core.prepare(proto, carrier))
            except InvalidArgument as exc:
                raise exc.renamed(_prompt_field(exc.param, i if len(protos) > 1 else None)) from None
    except BaseException as exc:
        for p in prepared:
            p.trace.fail(exc)
        raise
    return prepared


def _prompt_field(field: str, i: int | None) -> str:
    """The pipeline's ``prompt`` / ``prompt_token_ids[j]`` as the HTTP body's field: ``prompt``,
    ``prompt[j]`` (token ids), or, in a batch, ``prompt[i]`` / ``prompt[i][j]``."""
    if not (field == "prompt" or field.startswith("prompt_token_ids")):
        return field
    at = "" if i is None else f"[{i}]"
    return "prompt" + at + field.removeprefix("prompt_token_ids").removeprefix("prompt")


async def _parse(request: Request, body_cls: type[pydantic.BaseModel], max_bytes: int):
    """The request's JSON body as ``body_cls``. Raises NotJson, BodyTooLarge, or
    InvalidArgument naming the first field at fault (ValueError when none is)."""
    _check_json(request)
    data = await _read_body(request, max_bytes)
    try:
        return body_cls.model_validate_json(data)
    except pydantic.ValidationError as exc:
        e = exc.errors()[0]
        loc = _field_path(e["loc"])
        if e["type"] == "extra_forbidden":  # as OpenAI's server words it, naming the key
            raise InvalidArgument(loc or "request",
                                  f"unrecognized request argument {e['loc'][-1]!r}") from None
        raise (InvalidArgument(loc, e["msg"]) if loc else ValueError(e["msg"])) from None


def _check_json(request: Request) -> None:
    """Raises NotJson when the body is declared as something other than JSON (no
    Content-Type is taken as JSON, as curl's users expect)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise NotJson(f"request body: declared as {media or declared!r}; send JSON "
                      "(Content-Type: application/json)")


def _field_path(loc) -> str:
    """pydantic's error location as a field path: ``messages[0].content``. Union members'
    tags (``str``, ``list[int]``, ``function-after[...]``) are not fields and are left out."""
    path = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part.islower() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


async def _collect_unless_gone(request: Request, responses, n: int) -> list[list] | None:
    """Every choice's responses, by index; None when the client went away first (the
    responses are closed then, which aborts the request). Raises the pipeline's errors."""
    async def collect() -> list[list]:
        by_choice: list[list] = [[] for _ in range(n)]
        async with aclosing(responses) as rs:
            async for index, msg in rs:
                by_choice[index].append(msg)
        return by_choice

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()  # NOTE: the relays record the outcome shielded from this cancel
            await asyncio.wait({work})
    return None if work.cancelled() else work.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (ASGI ``http.disconnect``); the body
    must have been read already."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused (BodyTooLarge) as soon as it is known to exceed ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge("request", f"{declared} bytes exceed the gateway's limit of {max_bytes} "
                           "bytes (setting max_request_bytes)")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > max_bytes:
            raise BodyTooLarge("request", f"more than {max_bytes} bytes, the gateway's limit "
                               "(setting max_request_bytes)")
        parts.append(part)
    return b"".join(parts)


async def _sse(first, responses, chunker: Chunker, include_usage: bool):
    try:
        yield _event(chunker.chunk(*first))
        async with aclosing(responses) as rs:
            async for index, msg in rs:
                yield _event(chunker.chunk(index, msg))
        if include_usage:
            yield _event(chunker.usage_chunk())
    except Exception as exc:  # noqa: BLE001 — the stream has started: an error event
        status = _status(exc)
        yield _event(error_body(status.message, status.http_status, status.param, status.code))
    yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _status(exc: Exception) -> ErrorStatus:
    """``services.errors.error_status``, the traceback logged for an internal error."""
    status = error_status(exc)
    if status.internal:
        log.exception("HTTP request failed")
    return status


def _error_response(exc: Exception, headers: dict) -> JSONResponse:
    status = _status(exc)
    if status.http_status == 429:  # a per-key limit knows when it passes (services/gateway/limits.py)
        headers = {**headers, "Retry-After": str(getattr(exc, "retry_after_s", RETRY_AFTER_S))}
    return JSONResponse(error_body(status.message, status.http_status, status.param, status.code),
                        status_code=status.http_status, headers=headers)


class HttpServer(uvicorn.Server):
    """uvicorn on the running loop; the gateway, not uvicorn, handles SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
