"""A small synchronous client for the Gateway (used by ``tandem chat`` and ``tandem up --chat``)."""
from __future__ import annotations

import sys
from collections.abc import Iterator

import grpc

from services.api import gateway_pb2, gateway_pb2_grpc


def stream_chat(address: str, messages: list[dict[str, str]], timeout_s: float = 600.0,
                api_key: str | None = None, **options) -> Iterator[gateway_pb2.GenerateResponse]:
    """Stream a chat completion from the gateway at ``address`` (host:port), sending
    ``api_key`` (if any) as ``authorization: Bearer`` metadata.

    ``options`` are GenerateRequest fields (``max_tokens``, ``temperature``, ...).
    Raises ``grpc.RpcError`` with the server's status on failure.
    """
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(
            messages=[gateway_pb2.ChatMessage(**m) for m in messages], **options)
        yield from stub.Generate(request, timeout=timeout_s, metadata=metadata)


def print_chat(address: str, messages: list[dict[str, str]], out=sys.stdout, **options) -> str:
    """Stream one answer to ``out`` as it arrives; returns the whole text."""
    parts = []
    for msg in stream_chat(address, messages, **options):
        parts.append(msg.text)
        out.write(msg.text)
        out.flush()
        if msg.finish_reason:
            u = msg.usage
            out.write(f"\n[finish_reason={msg.finish_reason} prompt_tokens={u.prompt_tokens} "
                      f"completion_tokens={u.completion_tokens}]\n")
    return "".join(parts)


def chat_repl(address: str, **options) -> None:
    """Read user lines from stdin, keep the conversation, print each streamed answer."""
    history: list[dict[str, str]] = []
    for line in sys.stdin:
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.strip()})
        answer = print_chat(address, history, **options)
        history.append({"role": "assistant", "content": answer})
