"""TEST ONLY: per-request fault injection on the prefill worker, so integration tests can make
one KV handoff fail, stall or wait without touching any other request.

Off unless the worker was started with ``TANDEM_TEST_FAULT_INJECTION=1`` (never set it in a
deployment). When on, tags in a request id select faults, like fault-injection headers in a
service mesh: ``"req-7+fail_kv_write"``, ``"req-8+kv_write_delay=1.5+queue_delay=2"``.

- ``fail_kv_write``: the KV write raises ``KVTransferError`` before sending a byte (a failed
  transfer; the worker then reports it to the decode worker like any other failure).
- ``kv_write_delay=S``: the write waits S seconds on its transfer thread first (a slow transfer;
  past the lease it is not sent at all).
- ``queue_delay=S``: the request waits S seconds in the worker before its prompt is scheduled.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_TAG = re.compile(r"\+(fail_kv_write|kv_write_delay|queue_delay)(?:=(\d+(?:\.\d+)?))?")


@dataclass(frozen=True)
class Faults:
    fail_kv_write: bool = False
    kv_write_delay_s: float = 0.0
    queue_delay_s: float = 0.0

    @classmethod
    def parse(cls, request_id: str, enabled: bool) -> Faults:
        """The faults tagged in ``request_id``; none unless ``enabled``."""
        if not enabled:
            return NO_FAULTS
        tags = {name: float(value or 0) for name, value in _TAG.findall(request_id)}
        return cls(fail_kv_write="fail_kv_write" in tags,
                   kv_write_delay_s=tags.get("kv_write_delay", 0.0),
                   queue_delay_s=tags.get("queue_delay", 0.0))


NO_FAULTS = Faults()
