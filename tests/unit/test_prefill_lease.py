"""The prefill worker keeps a reservation's lease alive while it computes (``_keep_lease``):
a renewal that fails on a busy peer is tried again while the lease lasts, a refusal stops the
renewals and marks the lease refused."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from services.api import worker_pb2
from services.kv_transfer import KVLeaseRefusedError, KVTransferError
from services.prefill.server import PrefillServicer, _Lease

LEASE_S = 2.0


class FakeTransport:
    """Answers renewals from a script: an exception to raise or the seconds granted."""

    def __init__(self, answers) -> None:
        self.answers, self.calls = list(answers), []

    def add_remote(self, metadata: bytes) -> str:
        return "peer"

    def renew_lease(self, peer: str, token: bytes, timeout_s: float) -> float:
        self.calls.append(time.monotonic())
        answer = self.answers.pop(0) if self.answers else LEASE_S
        if isinstance(answer, Exception):
            raise answer
        return answer


def keep(answers, run_s: float):
    """Run ``_keep_lease`` for ``run_s`` seconds against scripted answers; (lease, transport,
    whether the renewing task was still running when cancelled)."""
    transport = FakeTransport(answers)
    servicer = SimpleNamespace(transport=transport)
    dest = worker_pb2.KVReservation(worker_id="decode-0", write_token=b"t")

    async def run():
        lease = _Lease(LEASE_S)
        task = asyncio.ensure_future(PrefillServicer._keep_lease(servicer, dest, lease))
        await asyncio.sleep(run_s)
        running = not task.done()
        task.cancel()
        return lease, running

    lease, running = asyncio.run(run())
    return lease, transport, running


def test_a_failed_renewal_is_tried_again_and_the_lease_lives_on():
    start = time.monotonic()
    lease, transport, running = keep([KVTransferError("timed out")], run_s=3.0)
    assert running and len(transport.calls) >= 3  # the failure, its retry, later renewals
    assert lease.deadline > start + 3.0 and not lease.refused.is_set()


def test_a_refused_renewal_stops_renewing_and_marks_the_lease_refused():
    lease, transport, running = keep([KVLeaseRefusedError("closed")], run_s=1.0)
    assert not running and len(transport.calls) == 1 and lease.refused.is_set()


def test_renewals_that_keep_failing_stop_when_the_lease_has_ended():
    start = time.monotonic()
    lease, transport, running = keep([OSError("reset")] * 100, run_s=2.5)
    assert not running and not lease.refused.is_set()
    assert lease.deadline < start + LEASE_S and transport.calls[-1] >= lease.deadline
