"""An admitted request's bookkeeping at the gateway: the worker calls Abort must cancel, its
Redis writes (queued in order, best effort), and its outcome, recorded once at the end."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

import redis

from services.api import gateway_pb2
from services.errors import InvalidArgument, Unavailable
from services.state.store import RequestState, RequestStateStore

log = logging.getLogger(__name__)


class RequestRecord:
    """One admitted request: ``track`` its worker calls, ``write`` its state, ``finish`` once.

    The outcome follows from what was seen: aborted (Abort, client gone, a worker's "abort"),
    failed (``error`` set), else finished with ``finish_reason``.
    """

    def __init__(self, store: RequestStateStore, request_id: str, key_id: str = "") -> None:
        self.store = store
        self.request_id = request_id
        self.key_id = key_id  # the API key that created it ("" anonymous); only it may Abort
        self._on_finish: list = []  # callbacks(record) run once at the end
        self.calls: list = []  # grpc.aio calls and tasks to this request's workers
        self.aborted = False  # Abort was called
        self.num_output_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the worker that computed the prompt found cached
        self.finish_reason = ""  # set when the last response went out
        self.error: str | None = None  # set when the request failed
        self._writes: asyncio.Future | None = None  # the latest queued Redis write

    def track(self, call):
        """Register a worker call or task that Abort must cancel; returns it."""
        self.calls = [c for c in self.calls if not c.done()]
        self.calls.append(call)
        if self.aborted:
            call.cancel()
        return call

    def cancel(self) -> None:
        for c in self.calls:
            c.cancel()

    def abort(self) -> None:
        self.aborted = True
        self.cancel()

    def on_tokens(self, count: int) -> None:
        """``count`` new output tokens are on their way to the client (DECODING at the first)."""
        if self.num_output_tokens == 0:
            self.write(self.store.transition(self.request_id, RequestState.DECODING,
                                             first_token_time=time.time()))
        self.num_output_tokens += count

    def write(self, coro: Awaitable) -> None:
        """Queue a Redis write after the request's earlier ones (best effort: a failure is logged)."""
        previous = self._writes

        async def write():
            if previous is not None:
                await asyncio.wait({previous})
            await redis_call(coro, raise_=False)

        self._writes = asyncio.ensure_future(write())

    def outcome(self) -> tuple[RequestState, dict[str, Any]]:
        """The terminal state and the fields recorded with it."""
        if self.aborted or self.finish_reason == "abort" or (not self.finish_reason and self.error is None):
            return RequestState.ABORTED, {"finish_reason": "abort"}  # no reason, no error: cancelled
        if self.error is not None:
            return RequestState.FAILED, {"error": self.error}
        return RequestState.FINISHED, {"finish_reason": self.finish_reason}

    def usage(self, prompt_tokens: int) -> gateway_pb2.Usage:
        """The request's token counts so far (OpenAI's ``usage``; ``cached_tokens``: prefix-cache
        hits the worker that computed the prompt reported)."""
        completion = self.num_output_tokens
        return gateway_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                                 total_tokens=prompt_tokens + completion,
                                 cached_tokens=self.num_cached_tokens)

    def on_finish(self, callback) -> None:
        """Call ``callback(record)`` when the request ends (e.g. a per-key limit's release)."""
        self._on_finish.append(callback)

    async def finish(self) -> None:
        """Wait for the queued writes, then record the outcome (never raises for Redis)."""
        callbacks, self._on_finish = self._on_finish, []
        for callback in callbacks:
            callback(self)
        if self._writes is not None:
            await asyncio.wait({self._writes})
        state, fields = self.outcome()
        await redis_call(self.store.transition(self.request_id, state,
                                               output_tokens=self.num_output_tokens, **fields),
                         raise_=False)


async def redis_call(coro: Awaitable, raise_: bool = True):
    """Await a Redis operation. Unreachable Redis: UNAVAILABLE naming it, or with ``raise_``
    False a logged warning (as is a record gone missing, e.g. after Redis restarted empty)."""
    try:
        return await coro
    except (redis.RedisError, OSError, TimeoutError) as exc:
        if raise_:
            raise Unavailable(f"request-state store (Redis) unreachable: {exc}") from exc
        log.warning("request-state store (Redis) write failed: %s", exc)
    except KeyError as exc:
        if raise_:
            raise InvalidArgument("request_id", str(exc.args[0])) from None
        log.warning("request-state store (Redis): %s", exc.args[0])
