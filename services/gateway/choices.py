"""OpenAI's ``n`` and a completions batch: one request, n independent choices for each of its
prompts (vLLM v1's parallel sampling, ``vllm/v1/engine/parallel_sampling.py``).

Each choice is a request of its own through the shared pipeline (its own Redis record, KV
reservation and decode stream). Choice ``index`` is ``prompt * n + j`` (OpenAI's order of a
batch's choices), id ``{request_id}-{index}`` when there is more than one; with a seed, choice
j of a prompt samples with ``seed + j`` (as vLLM does), so a choice equals a single request for
its prompt with that seed. A prompt's choices 1..n-1 are dispatched once its choice 0 has its
first token: by then the prefill worker has the prompt's full blocks in its prefix cache, so
the others compute only the prompt's last partial block
(``usage.prompt_tokens_details.cached_tokens`` shows the hits of choice 0).
A greedy request with n > 1 is allowed (vLLM allows it); its choices are equal.

``Choices.stream()`` yields ``(index, GenerateResponse)`` in arrival order; the first error of
any choice ends it, and closing it (a client gone, an error) cancels every choice: their blocks
are freed and Redis records them ABORTED.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

from services.api import gateway_pb2
from services.gateway.access import Access
from services.gateway.keys import Identity
from services.gateway.pipeline import GatewayCore, Prepared
from services.gateway.records import RequestRecord

SEED_MODULUS = 2**63  # SamplingParams' seed range
_END = object()  # a choice's stream ended


def child_requests(prompts: list[Prepared], n: int) -> list[Prepared]:
    """The n choices of each of ``prompts``, by index ``prompt * n + j``: ids ``{id}-{index}``
    (when there is more than one) and seeds ``seed + j``."""
    if len(prompts) * n == 1:
        return list(prompts)
    children = []
    for i, prepared in enumerate(prompts):
        seed = prepared.params.seed
        children += [replace(prepared, request_id=f"{prepared.request_id}-{i * n + j}",
                             params=prepared.params if seed is None else
                             prepared.params.model_copy(update={"seed": (seed + j) % SEED_MODULUS}))
                     for j in range(n)]
    return children


class Choices:
    """The admitted choices of one request (``n`` per prompt); ``stream()`` relays them all,
    merged."""

    def __init__(self, core: GatewayCore, children: list[Prepared], records: list[RequestRecord],
                 n: int = 1) -> None:
        self.core = core
        self.children = children
        self.records = records
        self.n = n

    @classmethod
    async def admit(cls, core: GatewayCore, prompts: list[Prepared], n: int, access: Access,
                    identity: Identity) -> Choices:
        """Admit the n choices of each of ``prompts`` for ``identity``'s key, all or none.
        Raises as ``Access.admit_all``."""
        children = child_requests(prompts, n)
        return cls(core, children, await access.admit_all(core, children, identity), n)

    async def stream(self) -> AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]]:
        """(choice index, response) as they arrive. Raises the first choice's error."""
        if len(self.children) == 1:
            async with aclosing(self.core.relay(self.children[0], self.records[0])) as responses:
                async for response in responses:
                    yield 0, response
            return
        queue: asyncio.Queue = asyncio.Queue()
        first_tokens = [asyncio.Event() for _ in range(0, len(self.children), self.n)]  # per prompt
        pumps = [asyncio.ensure_future(self._pump(i, queue, first_tokens[i // self.n]))
                 for i in range(len(self.children))]
        try:
            left = len(pumps)
            while left:
                index, item = await queue.get()
                if item is _END:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for pump in pumps:
                pump.cancel()  # each relay records its choice ABORTED unless it finished

    async def _pump(self, i: int, queue: asyncio.Queue, first_token: asyncio.Event) -> None:
        """Relay choice ``i`` into ``queue``; a prompt's choices after its first wait for that
        one's first token (``first_token``)."""
        prepared, record = self.children[i], self.records[i]
        try:
            if i % self.n:
                try:
                    await first_token.wait()
                except asyncio.CancelledError:
                    self.core.release(prepared.request_id, record)  # never relayed
                    raise
            async with aclosing(self.core.relay(prepared, record)) as responses:
                async for response in responses:
                    queue.put_nowait((i, response))
                    first_token.set()
        except Exception as exc:  # noqa: BLE001 — handed to the reader, who raises it
            queue.put_nowait((i, exc))
        finally:
            first_token.set()
            queue.put_nowait((i, _END))
