"""Decode-side KV reservations: when a reserved block may be freed.

Invariant: a block reserved for a prompt's KV is freed (or reused for a local prefill) only when
no write into it can still be in flight, and never later than the lease's end. So a reservation
is *closed* by exactly one of, whichever comes first:

- the prefill worker's notification: ``landed`` (the KV is written) or ``not_written`` (sent
  after its write, if any, has ended: cancelled, failed, lease too short);
- the lease's end: prefill workers end every write before it (they died, or gave up), and the
  KV transport admits none after it (nor lands an admitted one's bytes). The prefill worker
  renews the lease while it computes (``lease_left``: the transport's grant is the clock);
- an Abort with ``reservation_unused``: the gateway never asked a prefill worker to write.

While the request's Decode stream is attached, the close is handed to it as an ``Outcome``. A
stream that goes away first (client cancel, gateway abort) *detaches* the reservation: the
blocks stay quarantined until the close, which then frees them.

All methods run on the event loop thread (the transport's notifications are posted there).
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

MAX_CLOSED_KEPT = 256  # closed reservations remembered for GetLoad
CloseKind = Literal["landed", "not_written", "expired", "unused", "aborted"]


@dataclass(frozen=True)
class Outcome:
    kind: CloseKind
    note: dict = field(default_factory=dict)  # the prefill worker's notification, if any

    @property
    def why(self) -> str:
        """One line for errors and logs: why the KV did not arrive."""
        if self.kind == "expired":
            return "the prompt's KV did not arrive within the reservation's lease"
        if self.kind == "unused":
            return "the reservation was released unused"
        if self.kind == "aborted":
            return "the request was aborted"
        return f"the prompt's KV was not written ({self.note.get('reason', 'no reason given')})"


@dataclass
class _Reservation:
    outcome: asyncio.Future[Outcome]
    timer: asyncio.TimerHandle
    lease_left: Callable[[], float]  # seconds left of the lease, renewals included
    on_close: Callable[[], None]  # revokes the write grant: no write is admitted any more
    on_detach: Callable[[], None]  # stops renewals: a stream that went away needs no KV
    attached: bool = True


class Reservations:
    """Open reservations by request id. ``free(request_id)`` releases a closed reservation's
    blocks whose stream has gone (it must not block: it posts to the engine thread)."""

    def __init__(self, free: Callable[[str], None]) -> None:
        self._free = free
        self._open: dict[str, _Reservation] = {}
        # how the latest reservations closed, oldest first (reported by GetLoad, for tests)
        self.closed: OrderedDict[str, Outcome] = OrderedDict()
        self.closes: dict[str, int] = {}  # reservations closed so far, by kind (for metrics)

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def open(self, request_id: str, lease_s: float,
             lease_left: Callable[[], float] | None = None,
             on_close: Callable[[], None] | None = None,
             on_detach: Callable[[], None] | None = None) -> asyncio.Future[Outcome]:
        """Start the lease (seconds); the future resolves when the reservation closes.

        ``lease_left()``: seconds left of a lease that may have been renewed (the transport's
        write grant); asked when ``lease_s`` is up, and the lease ends only once it says 0.
        ``on_close()`` runs when the reservation closes, however it does (revoke the grant);
        ``on_detach()`` when its stream goes away first (stop renewals: the lease runs out)."""
        loop = asyncio.get_running_loop()
        timer = loop.call_later(lease_s, self._lease_up, request_id)
        self._open[request_id] = _Reservation(loop.create_future(), timer,
                                              lease_left or (lambda: 0.0),
                                              on_close or (lambda: None),
                                              on_detach or (lambda: None))
        return self._open[request_id].outcome

    def _lease_up(self, request_id: str) -> None:
        r = self._open.get(request_id)
        if r is None:
            return
        left = r.lease_left()
        if left > 0:  # renewed (or a write still landing): look again when it may end
            r.timer = asyncio.get_running_loop().call_later(left, self._lease_up, request_id)
            return
        self.close(request_id, Outcome("expired"))

    def close(self, request_id: str, outcome: Outcome) -> bool:
        """Close a reservation: hand ``outcome`` to its stream, or free a detached one's blocks.
        False when it is not open (already closed, or never ours: a late notification)."""
        r = self._open.pop(request_id, None)
        if r is None:
            if outcome.kind != "expired":
                log.info("request %s: %s for a reservation that is not open", request_id, outcome.kind)
            return False
        r.timer.cancel()
        r.on_close()
        self.closed[request_id] = outcome
        self.closes[outcome.kind] = self.closes.get(outcome.kind, 0) + 1
        if len(self.closed) > MAX_CLOSED_KEPT:
            self.closed.popitem(last=False)
        if r.attached and not r.outcome.done():
            r.outcome.set_result(outcome)
        else:
            log.info("request %s: quarantined reservation closed (%s): blocks freed",
                     request_id, outcome.kind)
            self._free(request_id)
        return True

    def abort(self, request_id: str) -> bool:
        """End the attached stream with an ``aborted`` outcome but keep the reservation open:
        a prefill worker may still write, so the blocks stay quarantined until it closes."""
        r = self._open.get(request_id)
        if r is None:
            return False
        r.attached = False
        r.on_detach()
        if not r.outcome.done():
            r.outcome.set_result(Outcome("aborted"))
        return True

    def detach(self, request_id: str) -> bool:
        """The stream went away. True when the reservation is still open: its blocks stay
        quarantined until it closes; False when the caller may free the request now."""
        r = self._open.get(request_id)
        if r is None:
            return False
        r.attached = False
        r.on_detach()
        return True
