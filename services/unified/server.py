"""Unified worker: one engine that computes each prompt and decodes it, behind the same gateway.

It serves the ``DecodeWorker`` service (``Decode``, ``Abort``, ``GetLoad``), so the gateway's
routing, cancellation, migration and request records are the decode worker's: the gateway sends
``Decode`` with ``local_prefill`` set and no prefill worker is involved. The prompt's KV comes
from this engine's own prefill (the decode worker's ``local_prefill`` path), so there is no
reservation, no lease on a KV write and no KV transport: the engine's scheduler admits the
prompt under its token budget (chunked prefill) beside the running batch's decode rows, and the
stream's first message is the first token. This is the colocated baseline that disaggregation
is measured against (DistServe section 2: colocated prefill and decode interfere; on a machine
with few cores, one engine that uses every core for whatever is waiting may still be faster).
"""
from __future__ import annotations

from services.api import worker_pb2
from services.decode.server import DecodeServicer
from services.errors import InvalidArgument


class UnifiedServicer(DecodeServicer):
    """``DecodeServicer`` without a KV transport: every ``Decode`` computes its prompt here.

    Raises ValueError (INVALID_ARGUMENT) naming ``local_prefill`` on a ``Decode`` without it:
    nothing can write a prompt's KV into a unified worker."""

    def _create_transport(self) -> None:
        """None: nothing writes a prompt's KV into a unified worker (its reservations stay empty)."""
        return None

    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        if not request.local_prefill:
            raise InvalidArgument("local_prefill", f"unified worker {self.rt.worker_id} computes every "
                                  "prompt itself; it takes no KV reservation (send local_prefill=true)")
        async for msg in super().Decode(request, context):
            yield msg
