"""What GetLoad reports beyond the registry's figures: each held request's stage, the
high-water marks, and how a decode worker's reservations closed (no model, no network)."""
from __future__ import annotations

import asyncio

from services.decode.reservations import MAX_CLOSED_KEPT, Outcome, Reservations
from services.engine.block_manager import BlockManager
from services.engine.request import Request, RequestStatus
from services.engine.sampling_params import SamplingParams
from services.runtime.worker import request_stage

SP = SamplingParams(temperature=0, max_tokens=4)


def req(status: RequestStatus, computed: int = 0, prompt: int = 8) -> Request:
    r = Request("r", [1] * prompt, SP)
    r.status, r.num_computed_tokens = status, computed
    return r


def test_request_stage_follows_the_engine_state():
    assert request_stage(None, streamed=True) == "queued"  # accepted, not in the engine yet
    assert request_stage(req(RequestStatus.WAITING), True) == "queued"
    assert request_stage(req(RequestStatus.PREEMPTED, 4), True) == "queued"
    assert request_stage(req(RequestStatus.RUNNING, 4), True) == "prefilling"
    assert request_stage(req(RequestStatus.RUNNING, 8), True) == "decoding"
    assert request_stage(req(RequestStatus.WAITING_FOR_KV), True) == "waiting_for_kv"
    assert request_stage(req(RequestStatus.WAITING_FOR_KV), False) == "quarantined"
    assert request_stage(req(RequestStatus.FINISHED_LENGTH, 8), True) == "transferring"


def test_block_manager_keeps_its_high_water_mark():
    bm = BlockManager(8, 4)
    a, b = Request("a", [1] * 12, SP), Request("b", [1] * 8, SP)
    assert bm.allocate_slots(a, 12) and bm.allocate_slots(b, 8)
    assert bm.max_used_blocks == 5
    bm.free(a)
    assert bm.num_used_blocks == 2 and bm.max_used_blocks == 5
    assert bm.allocate_slots(Request("c", [1] * 4, SP), 4)
    assert bm.max_used_blocks == 5


async def test_reservations_remember_how_they_closed():
    freed: list[str] = []
    r = Reservations(freed.append)
    r.open("landed", 60), r.open("cancelled", 60), r.open("expired", 0.01)
    r.close("landed", Outcome("landed"))
    assert r.detach("cancelled")
    r.close("cancelled", Outcome("not_written", {"reason": "prefill cancelled"}))
    deadline = asyncio.get_running_loop().time() + 10
    while "expired" in r:  # its 10 ms lease ends it
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    assert {rid: (o.kind, o.note.get("reason")) for rid, o in r.closed.items()} == {
        "landed": ("landed", None), "cancelled": ("not_written", "prefill cancelled"),
        "expired": ("expired", None)}
    assert freed == ["cancelled"]
    for i in range(MAX_CLOSED_KEPT):
        r.open(f"x{i}", 60)
        r.close(f"x{i}", Outcome("unused"))
    assert len(r.closed) == MAX_CLOSED_KEPT and "landed" not in r.closed
