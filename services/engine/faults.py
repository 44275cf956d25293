"""TEST ONLY: per-request fault injection inside the engine step, so tests can make one
request raise where a poison request would, and check that it fails alone.

Off unless the engine was built with ``fault_injection=True`` (a worker passes
``WorkerOptions.fault_injection``, set by ``TANDEM_TEST_FAULT_INJECTION=1``; never in a
deployment). When on, tags in a request id select faults, as in ``services/prefill/faults.py``:

- ``+raise_in_step=N``: running the model for a step that holds this request raises
  ``InjectedFault`` once the request has N output tokens (default 0: in its prefill); the step
  fails as a whole, and again whenever this request is run, alone or not.
- ``+crash_engine=N``: once the request has N output tokens, the step raises after running the
  model, where no request can be blamed: the engine cannot continue.
"""
from __future__ import annotations

import re

from .scheduler import SchedulerOutput

_TAG = re.compile(r"\+(raise_in_step|crash_engine)(?:=(\d+))?")


class InjectedFault(RuntimeError):
    """Raised by an injected fault."""


class EngineFaults:
    """Checks a step's requests for fault tags (cheap: one regex per scheduled request)."""

    def __init__(self) -> None:
        self._tags: dict[str, dict[str, int]] = {}

    def _of(self, request_id: str) -> dict[str, int]:
        tags = self._tags.get(request_id)
        if tags is None:
            tags = {name: int(n or 0) for name, n in _TAG.findall(request_id)}
            self._tags[request_id] = tags
        return tags

    def _due(self, out: SchedulerOutput, name: str) -> str | None:
        for r in out.scheduled:
            n = self._of(r.request_id).get(name)
            if n is not None and len(r.output_token_ids) >= n:
                return r.request_id
        return None

    def before_execute(self, out: SchedulerOutput) -> None:
        """Raise for a ``raise_in_step`` request that is due in ``out``."""
        if (rid := self._due(out, "raise_in_step")) is not None:
            raise InjectedFault(f"injected fault: raise_in_step ({rid})")

    def after_execute(self, out: SchedulerOutput) -> None:
        """Raise for a ``crash_engine`` request that is due in ``out``."""
        if (rid := self._due(out, "crash_engine")) is not None:
            raise InjectedFault(f"injected fault: crash_engine ({rid})")

    def forget(self, request_id: str) -> None:
        self._tags.pop(request_id, None)
