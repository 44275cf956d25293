"""A decode worker's Follow stream (worker.proto ``Follow``): one stream carries the token
messages of every request whose Decode names it, at most one update per request a message; the
tokens are exactly those the request's own stream gives; the Decode stream itself carries only
the admission and its end. Unread for ``kv_lease_s``, or ended by its caller, it releases its
requests and their blocks come back. The servicer runs in-process over a real engine; the test
drives its handlers directly."""
from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from services.api import worker_pb2
from services.decode.server import DecodeServicer
from services.errors import InvalidArgument, Unavailable
from services.gateway.follow import Inbox
from services.runtime.worker import WorkerRuntime
from tests.unit.test_stream_lease import LEASE_S, NUM_BLOCKS, _until, _with_servicer, engine  # noqa: F401

FOLLOWER = "f" * 32
PROMPTS = ([1, 9690, 198, 19556, 314, 260], [1, 9690, 198, 2683, 3437, 28])


def _request(rid: str, prompt: list[int], max_tokens: int, follower_id: str = "",
             ) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, local_prefill=True, follower_id=follower_id,
        sampling_params=worker_pb2.SamplingParams(max_tokens=max_tokens, top_p=1.0,
                                                   repetition_penalty=1.0, ignore_eos=True))


async def _decode(servicer: DecodeServicer, request: worker_pb2.DecodeRequest) -> list:
    return [m async for m in servicer.Decode(request, None)]


def test_followed_requests_get_the_tokens_of_their_own_streams(engine):
    async def body(runtime: WorkerRuntime, servicer: DecodeServicer):
        alone = [await _decode(servicer, _request(f"alone{i}", p, 24)) for i, p in enumerate(PROMPTS)]
        expected = {f"r{i}": [t for m in msgs for t in m.token_ids] for i, msgs in enumerate(alone)}
        follow = servicer.Follow(worker_pb2.FollowRequest(follower_id=FOLLOWER), None)
        assert not (await follow.__anext__()).updates  # open: Decode may name it now
        decodes = [asyncio.ensure_future(_decode(servicer, _request(rid, p, 24, FOLLOWER)))
                   for rid, p in zip(expected, PROMPTS)]
        got: dict[str, list[int]] = {rid: [] for rid in expected}
        finished: set[str] = set()
        while finished != set(expected):
            msg = await follow.__anext__()
            counts = Counter(u.request_id for u in msg.updates)
            assert counts and max(counts.values()) == 1  # at most one update per request
            for u in msg.updates:
                assert u.request_id not in finished
                got[u.request_id].extend(u.token_ids)
                assert u.num_output_tokens == len(got[u.request_id])
                if u.finish_reason:
                    assert u.finish_reason == "length"
                    finished.add(u.request_id)
        assert got == expected  # greedy: the same tokens whichever stream carries them
        for d in decodes:  # each Decode stream: the admission (empty), then its OK end
            assert [m.token_ids for m in await d] == [[]]
        await follow.aclose()
        assert not servicer.follows and not runtime.streams
        assert engine.block_manager.num_free_blocks == NUM_BLOCKS

    asyncio.run(_with_servicer(engine, body))


def test_an_unread_follow_stream_releases_its_requests(engine):
    async def body(runtime: WorkerRuntime, servicer: DecodeServicer):
        follow = servicer.Follow(worker_pb2.FollowRequest(follower_id=FOLLOWER), None)
        await follow.__anext__()
        started = time.monotonic()
        decode = asyncio.ensure_future(_decode(servicer, _request("idle", PROMPTS[0], 4000, FOLLOWER)))
        await _until(lambda: engine.block_manager.num_free_blocks < NUM_BLOCKS)
        # nobody reads the follow stream: the lease releases the request
        with pytest.raises(Unavailable, match="unread"):
            await decode
        assert time.monotonic() - started >= LEASE_S
        await _until(lambda: engine.block_manager.num_free_blocks == NUM_BLOCKS)
        assert not engine.has_work() and not runtime.streams
        with pytest.raises(Exception, match="unread"):  # a late reader gets the stream's end
            async for _ in follow:
                pass
        assert not servicer.follows

    asyncio.run(_with_servicer(engine, body))


def test_a_follow_stream_ended_by_its_caller_releases_its_requests(engine):
    async def body(runtime: WorkerRuntime, servicer: DecodeServicer):
        follow = servicer.Follow(worker_pb2.FollowRequest(follower_id=FOLLOWER), None)
        await follow.__anext__()
        decode = asyncio.ensure_future(_decode(servicer, _request("gone", PROMPTS[1], 4000, FOLLOWER)))
        assert (await follow.__anext__()).updates[0].token_ids  # decoding
        await follow.aclose()  # the caller went away
        with pytest.raises(Unavailable, match="Follow stream ended"):
            await decode
        await _until(lambda: engine.block_manager.num_free_blocks == NUM_BLOCKS)
        assert not engine.has_work() and not runtime.streams and not servicer.follows

    asyncio.run(_with_servicer(engine, body))


def test_a_stopping_worker_ends_its_follow_streams_after_what_they_hold(engine):
    async def body(runtime: WorkerRuntime, servicer: DecodeServicer):
        follow = servicer.Follow(worker_pb2.FollowRequest(follower_id=FOLLOWER), None)
        await follow.__anext__()
        await _decode(servicer, _request("done", PROMPTS[0], 8, FOLLOWER))  # finished, unread
        servicer.stopping()
        rest = [m async for m in follow]  # what it held, merged, then an OK end
        assert [(u.request_id, len(u.token_ids), u.finish_reason)
                for m in rest for u in m.updates] == [("done", 8, "length")]
        assert not servicer.follows

    # the finished request's tokens wait unread while it decodes: a lease long enough for a
    # slow or busy machine (the short one is what the lease tests exercise)
    asyncio.run(_with_servicer(engine, body, lease_s=60.0))


def test_follow_ids_are_checked(engine):
    async def body(runtime: WorkerRuntime, servicer: DecodeServicer):
        with pytest.raises(InvalidArgument, match="follower_id"):
            await servicer.Follow(worker_pb2.FollowRequest(follower_id="short"), None).__anext__()
        follow = servicer.Follow(worker_pb2.FollowRequest(follower_id=FOLLOWER), None)
        await follow.__anext__()
        with pytest.raises(InvalidArgument, match="already open"):
            await servicer.Follow(worker_pb2.FollowRequest(follower_id=FOLLOWER), None).__anext__()
        with pytest.raises(Unavailable, match="follower_id"):
            await _decode(servicer, _request("nobody", PROMPTS[0], 4, "e" * 32))
        await follow.aclose()
        assert not runtime.streams and engine.block_manager.num_free_blocks == NUM_BLOCKS

    asyncio.run(_with_servicer(engine, body))


def test_the_gateway_inbox_merges_updates_a_slow_reader_left():
    async def body():
        inbox, end = Inbox(), asyncio.get_running_loop().create_future()
        inbox.put(worker_pb2.DecodeResponse(token_ids=[1], num_output_tokens=1, num_cached_tokens=4,
                                            logprobs=[worker_pb2.SampledLogprobs(token_id=1)]))
        inbox.put(worker_pb2.DecodeResponse(token_ids=[2, 3], num_output_tokens=3,
                                            logprobs=[worker_pb2.SampledLogprobs(token_id=2),
                                                      worker_pb2.SampledLogprobs(token_id=3)]))
        inbox.put(end)
        inbox.put(worker_pb2.DecodeResponse(token_ids=[4], num_output_tokens=4, finish_reason="stop"))
        first = await inbox.get()
        assert list(first.token_ids) == [1, 2, 3] and first.num_output_tokens == 3
        assert first.num_cached_tokens == 4 and not first.finish_reason
        assert [lp.token_id for lp in first.logprobs] == [1, 2, 3]
        assert await inbox.get() is end  # an event is never merged past
        last = await inbox.get()
        assert list(last.token_ids) == [4] and last.finish_reason == "stop"
        waiting = asyncio.ensure_future(inbox.get())
        await asyncio.sleep(0)
        assert not waiting.done()
        inbox.put(worker_pb2.DecodeResponse(token_ids=[5]))
        assert list((await waiting).token_ids) == [5]

    asyncio.run(body())
