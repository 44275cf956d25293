"""KV-cache transfer between prefill and decode workers: one interface, pluggable backends."""
from __future__ import annotations

import torch

from kernels.kv_layout import KVCacheLayout
from services.kv_transfer.errors import KVLayoutMismatchError, KVLeaseRefusedError, KVTransferError
from services.kv_transfer.handoff import EngineKVHooks
from services.kv_transfer.receiver import NotificationHandler
from services.kv_transfer.transport import KVTransport

BACKENDS = ("tcp", "nixl")

__all__ = [
    "BACKENDS", "EngineKVHooks", "KVLayoutMismatchError", "KVLeaseRefusedError", "KVTransferError", "KVTransport",
    "NotificationHandler", "create_transport",
]


def create_transport(
    backend: str, kv_cache: torch.Tensor, layout: KVCacheLayout, *, host: str, port: int,
    advertise_host: str | None = None, secret: str | None = None, require_grants: bool = False,
) -> KVTransport:
    """Build the ``backend`` transport over ``kv_cache``
    (``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, dtype ``layout.dtype``).

    "tcp" listens on ``host:port`` (0: ephemeral) and advertises ``advertise_host`` to peers.
    "nixl" ignores them: UCX picks its own interfaces and ports (``UCX_TLS``,
    ``UCX_NET_DEVICES``); its metadata carries them to peers. ``secret`` (the internal
    secret, proven in every handshake) and ``require_grants`` (admit only granted writes):
    see ``KVTransport``.

    Raises ValueError for an unknown backend or when ``kv_cache`` disagrees with ``layout``;
    ImportError (``NIXL_MISSING``: the package to install, and ``--kv-transport tcp``) for
    "nixl" without NIXL; KVTransferError when the NIXL agent cannot start.
    """
    if backend == "tcp":
        from services.kv_transfer.tcp import TcpKVTransport

        return TcpKVTransport(kv_cache, layout, host=host, port=port, advertise_host=advertise_host,
                              secret=secret, require_grants=require_grants)
    if backend == "nixl":
        from services.kv_transfer.nixl import NixlKVTransport

        return NixlKVTransport(kv_cache, layout, secret=secret, require_grants=require_grants)
    raise ValueError(f"unknown kv transfer backend {backend!r}; valid choices: {', '.join(BACKENDS)}")
