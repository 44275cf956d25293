"""Streaming clients of ``bench serve``: the Tandem gateway over gRPC and any OpenAI-compatible
HTTP server (``/v1/chat/completions`` or ``/v1/completions`` with SSE streaming).

``send(request, record, clock)`` fills a ``RequestRecord``: send time, one timestamp per streamed
message that carries tokens (TTFT and ITLs), the finish, token counts (the server's ``usage``
when it reports one) and, on failure, the error. It never raises for a failed request; it
records it. Requests are greedy (temperature 0) so runs repeat.

OpenAI SSE framing (vLLM, ``openai`` client): each event is ``data: <json>`` then a blank line;
the stream ends with ``data: [DONE]``; an event whose JSON has an ``error`` key is a failure;
with ``stream_options.include_usage`` the last chunk has ``choices: []`` and the ``usage``.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from urllib.parse import urlparse

import grpc
import httpx

from loadtest.datasets import SampleRequest
from loadtest.metrics import RequestRecord
from services.api import gateway_pb2, gateway_pb2_grpc

Clock = Callable[[], float]  # seconds on the run's clock


def parse_target(target: str) -> tuple[str, str]:
    """``grpc://HOST:PORT`` -> ("grpc", "HOST:PORT"); ``http(s)://HOST:PORT/v1`` ->
    ("http", the base URL without a trailing slash).

    Raises:
        ValueError: naming ``target`` when the scheme or address is missing.
    """
    url = urlparse(target)
    if url.scheme == "grpc" and url.netloc:
        return "grpc", url.netloc
    if url.scheme in ("http", "https") and url.netloc:
        return "http", target.rstrip("/")
    raise ValueError(f"target must be grpc://HOST:PORT or http://HOST:PORT/v1, got {target!r}")


def _stamp(record: RequestRecord, now: float, last: float | None) -> float:
    if last is None:
        record.first_token_s = now
    else:
        record.itl.append(now - last)
    return now


def _stream_error(num_tokens: int, finish_reason: str) -> str:
    """Why a gRPC stream that ended without an RPC error still failed ("" when it did not)."""
    if not finish_reason:
        return "stream ended without a finish_reason"
    if finish_reason == "abort":
        return "aborted by the server"
    return "" if num_tokens else "stream ended without a token"


class GrpcClient:
    """The Tandem gateway's streaming ``Generate``; chat requests go as ``messages`` (the
    gateway renders the template), others as a raw ``prompt``. ``channels``: connections,
    requests taking them in turn (gRPC shares one connection among a process's channels to an
    address unless each has a pool of its own, as here): gateways sharing a port
    (``up.num_gateways``) each get some."""

    def __init__(self, address: str, timeout_s: float = 300.0, channels: int = 1) -> None:
        self.address = address
        self.timeout_s = timeout_s
        options = [("grpc.use_local_subchannel_pool", 1)] if channels > 1 else []
        self._channels = [grpc.aio.insecure_channel(address, options=options)
                          for _ in range(channels)]
        self._stubs = itertools.cycle([gateway_pb2_grpc.GatewayStub(c) for c in self._channels])

    def _request(self, req: SampleRequest, request_id: str) -> gateway_pb2.GenerateRequest:
        fields = dict(request_id=request_id, max_tokens=req.output_len, temperature=0.0,
                      ignore_eos=req.ignore_eos)
        if req.messages:
            return gateway_pb2.GenerateRequest(
                messages=[gateway_pb2.ChatMessage(**m) for m in req.messages], **fields)
        return gateway_pb2.GenerateRequest(prompt=req.prompt, **fields)

    async def send(self, req: SampleRequest, record: RequestRecord, clock: Clock) -> None:
        record.sent_s, record.prompt_len = clock(), req.prompt_len
        last, count = None, 0
        try:
            stream = next(self._stubs).Generate(self._request(req, record.request_id),
                                                timeout=self.timeout_s)
            async for msg in stream:
                if msg.token_ids:
                    last = _stamp(record, clock(), last)
                    count += len(msg.token_ids)
                if msg.finish_reason:
                    record.finish_reason = msg.finish_reason
                    record.prompt_len = msg.usage.prompt_tokens or req.prompt_len
                    record.cached_tokens = msg.usage.cached_tokens
            record.output_tokens = count
            record.error = _stream_error(count, record.finish_reason)
            record.success = not record.error
        except grpc.aio.AioRpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"
        record.finish_s = clock()

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()



class OpenAIClient:
    """An OpenAI-compatible server at ``base_url`` (``http://HOST:PORT/v1``).

    endpoint: ``chat`` (``/chat/completions``; chat requests as ``messages``, others as one
    user turn) or ``completions`` (``/completions``; the raw ``prompt``). ``model`` empty: the
    first id of ``GET /models``. ``api_key`` goes as ``Authorization: Bearer``.
    """

    def __init__(self, base_url: str, endpoint: str = "chat", model: str = "", api_key: str = "",
                 timeout_s: float = 300.0) -> None:
        if endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be chat or completions, got {endpoint!r}")
        self.base_url, self.endpoint, self.model = base_url, endpoint, model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(headers=headers, timeout=timeout_s, limits=limits)

    async def resolve_model(self) -> str:
        """The model to name in requests (``model`` or the server's first). Raises
        ``ConnectionError`` naming the target when ``GET /models`` fails or lists none."""
        if not self.model:
            try:
                resp = await self._http.get(f"{self.base_url}/models")
                resp.raise_for_status()
                self.model = resp.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                raise ConnectionError(f"target {self.base_url}: GET /models gave no model "
                                      f"({type(exc).__name__}: {exc}); pass --model") from None
        return self.model

    def _payload(self, req: SampleRequest) -> tuple[str, dict]:
        body = {"model": self.model, "max_tokens": req.output_len, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": req.ignore_eos}
        if self.endpoint == "chat":
            body["messages"] = list(req.messages or ({"role": "user", "content": req.prompt},))
            return f"{self.base_url}/chat/completions", body
        body["prompt"] = req.prompt
        return f"{self.base_url}/completions", body

    async def send(self, req: SampleRequest, record: RequestRecord, clock: Clock) -> None:
        url, body = self._payload(req)
        record.sent_s = clock()
        try:
            async with self._http.stream("POST", url, json=body,
                                         headers={"X-Request-Id": record.request_id}) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:300]
                    record.error = f"HTTP {resp.status_code}: {text}"
                else:
                    await self._read_stream(resp, req, record, clock)
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.finish_s = clock()

    async def _read_stream(self, resp: httpx.Response, req: SampleRequest,
                           record: RequestRecord, clock: Clock) -> None:
        last, chunks, usage, done = None, 0, None, False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments (": ping"), other SSE fields
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                event = json.loads(data)
            except ValueError:
                record.error = f"not JSON in an SSE event: {data[:100]!r}"
                break
            if event.get("error"):
                err = event["error"]
                record.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                continue  # vLLM still sends [DONE] after an error event
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if self.endpoint == "chat" \
                    else choice.get("text")
                if text:
                    last = _stamp(record, clock(), last)
                    chunks += 1
                record.finish_reason = choice.get("finish_reason") or record.finish_reason
        record.prompt_len = (usage or {}).get("prompt_tokens") or req.prompt_len
        record.output_tokens = (usage or {}).get("completion_tokens") or chunks
        record.cached_tokens = ((usage or {}).get("prompt_tokens_details") or {}).get(
            "cached_tokens") or 0
        if not record.error and not done:
            record.error = "stream ended without [DONE]"
        record.success = not record.error and chunks > 0
        if not record.success and not record.error:
            record.error = "stream ended without a token"

    async def close(self) -> None:
        await self._http.aclose()
