"""services/decode/server.py: a stream's outputs leave in output order even when the first
token's output was queued after the next step's (the landing command's answer and the engine's
next output race to the event loop)."""
from __future__ import annotations

import asyncio

from services.decode.server import _batches
from services.engine.outputs import RequestOutput


def test_outputs_queued_out_of_order_leave_in_order():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(RequestOutput("r", [11], None, 5, 2))   # the step's: token #1
        queue.put_nowait(RequestOutput("r", [10], None, 5, 1))   # the landing's: token #0
        queue.put_nowait(RequestOutput("r", [12], "length", 5, 3))
        return await anext(_batches(queue))
    outs = asyncio.run(run())
    assert [t for o in outs for t in o.new_token_ids] == [10, 11, 12]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 3


def test_an_abort_behind_unread_tokens_still_ends_the_batch():
    """The lease's abort carries no tokens (count 0); it must still be the batch's last output,
    or the stream never sees its end."""
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(RequestOutput("r", [10], None, 5, 1))
        queue.put_nowait(RequestOutput("r", [11], None, 5, 2))
        queue.put_nowait(RequestOutput("r", [], "abort"))
        return await anext(_batches(queue))
    outs = asyncio.run(run())
    assert [t for o in outs for t in o.new_token_ids] == [10, 11]
    assert outs[-1].finish_reason == "abort"
