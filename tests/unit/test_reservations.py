"""Decode-side reservations (services/decode/reservations.py): the lease ends only when the
transport's grant says so (renewals included), and closing revokes the grant."""
from __future__ import annotations

import asyncio

from services.decode.reservations import Outcome, Reservations


def test_lease_ends_only_when_the_renewed_grant_has_ended():
    async def run():
        freed, revoked, asked = [], [], []
        lefts = [0.05, 0.05, 0.0]  # renewed twice, then over

        def lease_left() -> float:
            asked.append(1)
            return lefts[len(asked) - 1]

        r = Reservations(freed.append)
        outcome = r.open("req", 0.01, lease_left, lambda: revoked.append("req"))
        result = await asyncio.wait_for(outcome, 10)
        assert result.kind == "expired" and len(asked) == 3
        assert revoked == ["req"] and "req" not in r and freed == []

    asyncio.run(run())


def test_closing_early_revokes_and_a_detached_reservation_is_freed():
    async def run():
        freed, revoked = [], []
        r = Reservations(freed.append)
        r.open("a", 30.0, lambda: 30.0, lambda: revoked.append("a"))
        assert r.detach("a")  # the stream went away: quarantined until the close
        assert r.close("a", Outcome("not_written", {"reason": "x"}))
        assert revoked == ["a"] and freed == ["a"]
        assert not r.close("a", Outcome("landed"))  # a late note for a closed reservation

    asyncio.run(run())
