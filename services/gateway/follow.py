"""The gateway's token channel to a decode (or unified) worker: one ``Follow`` stream per worker.

Every attempt on a worker names the gateway's follower there in its ``Decode`` request; the
worker then sends the attempt's token messages through the follower, one message per step for
all of them, and keeps the attempt's own ``Decode`` stream for its reservation and its end
status (``worker.proto``). A step of a 16-request batch thus costs one gRPC message each way
instead of 16: the gateway's and the worker's per-message work (grpc's C core, the event loop's
wake-ups, protobuf) was most of the serving CPU per output token outside the model
(docs/benchmarks.md, serving CPU).

``Follower`` reads the stream and hands each update to its attempt's ``Inbox``; the dispatcher's
relay reads the inbox, where the attempt's other events (its ``Decode`` stream's end, its
prefill's answer) arrive too, so one wait covers them all. Updates the client has not taken yet
merge in the inbox: a client that reads slower than the worker produces gets fewer, larger
messages (as SGLang's ``stream_interval`` gives), and one that keeps up gets every step's.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import uuid

import grpc

from services.api import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class FollowLost(Exception):
    """The Follow stream ended: updates it would have carried are lost (the worker is gone, or
    the channel closed)."""


class Inbox:
    """One attempt's events in arrival order: ``DecodeResponse`` updates, ``FollowLost``, and
    done futures the relay registered (``put`` is a done callback)."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self):
        """The next event; consecutive updates at the head come merged into one message (token
        ids and logprobs appended, the last finish reason and count kept)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item = self._items.popleft()
        if isinstance(item, worker_pb2.DecodeResponse):
            while self._items and isinstance(self._items[0], worker_pb2.DecodeResponse):
                item.MergeFrom(self._items.popleft())
        return item


class Follower:
    """The gateway's Follow stream on one worker channel, opened at once; ``ready()`` before
    the first use. Updates go to the inbox registered under their request id (others are
    dropped: an attempt already released); when the stream ends every inbox gets ``FollowLost``
    and the follower stays ``lost`` (the dispatcher opens a new one)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.id = uuid.uuid4().hex
        self.inboxes: dict[str, Inbox] = {}
        self.lost = ""  # why the stream ended, once it has
        self._call = worker_pb2_grpc.DecodeWorkerStub(channel).Follow(
            worker_pb2.FollowRequest(follower_id=self.id))
        self._ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.ensure_future(self._read())

    async def ready(self, timeout_s: float) -> None:
        """Wait for the worker's first (empty) message. Raises FollowLost."""
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        except TimeoutError:
            raise FollowLost(f"Follow stream {self.id} not open after {timeout_s:.0f}s") from None

    def register(self, request_id: str) -> Inbox:
        """The inbox of a new attempt, before its Decode request names this follower. Raises
        FollowLost when the stream has ended."""
        if self.lost:
            raise FollowLost(self.lost)
        inbox = self.inboxes[request_id] = Inbox()
        return inbox

    def unregister(self, request_id: str) -> None:
        self.inboxes.pop(request_id, None)

    def close(self) -> None:
        self._call.cancel()

    async def _read(self) -> None:
        why = "Follow stream ended"
        try:
            if await self._call.read() is grpc.aio.EOF:
                return
            self._ready.set_result(None)
            inboxes = self.inboxes
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                for update in msg.updates:
                    inbox = inboxes.get(update.request_id)
                    if inbox is not None:
                        inbox.put(update)
        except grpc.aio.AioRpcError as exc:
            why = f"Follow stream: {exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            why = "Follow stream cancelled"
        finally:
            self.lost = why
            if not self._ready.done():
                self._ready.set_exception(FollowLost(why))
                self._ready.exception()  # retrieved: nobody may be waiting
            for inbox in self.inboxes.values():
                inbox.put(FollowLost(why))
            log.debug("follower %s: %s", self.id, why)
