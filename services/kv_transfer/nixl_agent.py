"""NIXL plumbing for the NIXL KV transport: loading the library, starting an agent, descriptor
rows, a peer's metadata, and the small records the transport keeps per peer and per call."""
from __future__ import annotations

import base64
import importlib
import json
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np

import logging

import torch

from kernels.kv_layout import KVCacheLayout
from services.kv_transfer.errors import KVTransferError
from services.kv_transfer.layouts import layout_from_dict, layout_to_dict

logger = logging.getLogger(__name__)

NIXL_MISSING = ("NIXL is not installed (pip install nixl-cu13, or nixl-cu12 beside a CUDA 12 "
                "torch); use --kv-transport tcp")
# the wheels we depend on (the CUDA image's, the CPU tests'), then the `nixl` meta package
_MODULES = ("nixl_cu13", "nixl_cu12", "nixl._api")


def load_nixl() -> ModuleType:
    """NIXL's Python API module. Raises ImportError naming the TCP fallback when absent."""
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except (ImportError, OSError):  # OSError: one of its shared libraries failed to load
            continue
    raise ImportError(NIXL_MISSING)


def descriptor_rows(base: int, count: int, size: int, device_id: int) -> np.ndarray:
    """``[count, 3]`` NIXL descriptors (address, bytes, device id) of back-to-back regions."""
    rows = np.empty((count, 3), dtype=np.uint64)
    rows[:, 0] = np.uint64(base) + np.arange(count, dtype=np.uint64) * np.uint64(size)
    rows[:, 1], rows[:, 2] = size, device_id
    return rows


def parse_metadata(metadata: bytes) -> dict:
    """A peer's ``metadata()`` as typed fields; raises KVTransferError when invalid."""
    try:
        meta = json.loads(metadata)
        if meta["backend"] != "nixl":
            raise KVTransferError(f"peer {meta.get('name')} uses backend {meta['backend']!r}, "
                                  "this one is 'nixl'")
        return {"name": str(meta["name"]), "layout": layout_from_dict(meta["layout"]),
                "num_blocks": int(meta["num_blocks"]), "base_addr": int(meta["base_addr"]),
                "device_id": int(meta["device_id"]), "mem_type": str(meta["mem_type"]),
                "agent_md": base64.b64decode(meta["agent_md"], validate=True)}
    except (ValueError, KeyError, TypeError) as exc:
        raise KVTransferError(f"invalid NIXL transport metadata: {exc!r}") from exc


@dataclass
class Peer:
    """A receiver this transport writes to."""

    num_blocks: int
    dlist: object  # its prepped descriptor list, one entry per (layer, K/V, block)


@dataclass
class Waiter:
    """A handshake or write waiting for the peer's answer."""

    done: threading.Event = field(default_factory=threading.Event)
    reply: dict | None = None  # the peer's answer
    error: str | None = None  # why it failed on our side: closed, peer gone


def start_agent(nixl: ModuleType, name: str, backends: list[str]):
    """A NIXL agent safe to call from many threads; raises KVTransferError when it fails.

    NOTE: no NIXL progress thread: the Python API starts it busy-polling (about 65% of a core
    per agent, measured); our poller's ``get_new_notifs`` calls make UCX progress instead.
    """
    config = nixl.nixl_agent_config(
        backends=backends, enable_prog_thread=False,
        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    try:
        agent = nixl.nixl_agent(name, config)
    except Exception as exc:
        raise KVTransferError(f"cannot start a NIXL agent with backends {backends}: {exc!r} "
                              "(check UCX_TLS / UCX_NET_DEVICES)") from exc
    if not agent.backends:
        raise KVTransferError(f"none of the NIXL backends {backends} is available")
    return agent


def register_cache(agent, kv_cache: torch.Tensor, layout: KVCacheLayout,
                   name: str) -> tuple[object, object, dict, bytes]:
    """Register each layer's K and V region of ``kv_cache`` with ``agent`` and prepare one
    descriptor per (layer, K/V, block). Returns (registration, local descriptor list, the
    handshake's ``{"layout", "agent_md"}``, ``metadata()``: JSON ``{"backend", "name", "layout",
    "agent_md", "num_blocks", "base_addr", "device_id", "mem_type"}``; ``agent_md`` is the
    base64 NIXL agent metadata: address + registrations). Raises KVTransferError."""
    on_gpu = kv_cache.device.type == "cuda"
    mem_type, device_id = ("VRAM" if on_gpu else "DRAM"), kv_cache.device.index or 0
    regions, base, num_blocks = 2 * layout.num_layers, kv_cache.data_ptr(), kv_cache.shape[2]
    size = layout.block_bytes
    try:
        registered = agent.register_memory(
            descriptor_rows(base, regions, num_blocks * size, device_id), mem_type)
        dlist = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", descriptor_rows(base, regions * num_blocks, size, device_id),
            mem_type)
        agent_md = base64.b64encode(agent.get_agent_metadata()).decode()
    except Exception as exc:  # NIXL's own error types
        raise KVTransferError(f"NIXL could not register the KV cache: {exc!r}") from exc
    hello = {"layout": layout_to_dict(layout), "agent_md": agent_md}
    metadata = json.dumps({"backend": "nixl", "name": name, **hello, "num_blocks": num_blocks,
                           "base_addr": base, "device_id": device_id, "mem_type": mem_type})
    return registered, dlist, hello, metadata.encode()


def descriptor_indices(num_blocks: int, block_ids: list[int],
                       layer_starts: tuple[int, ...]) -> np.ndarray:
    """Indices into a descriptor list of (layer, K/V) x ``num_blocks`` entries: ``block_ids``
    from position ``layer_starts[l]`` on in layer ``l``'s two regions, region-major (int32)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    return np.concatenate([
        np.concatenate([(2 * layer + kv) * num_blocks + ids[start:] for kv in (0, 1)])
        for layer, start in enumerate(layer_starts)]).astype(np.int32)


def encode_write(token: bytes, remote_ids: list[int], layer_starts: tuple[int, ...],
                 notification: bytes) -> bytes:
    """A write's message body: 4-byte length, JSON ``{"token", "remote_block_ids",
    "layer_starts"}``, the user's notification bytes."""
    head = json.dumps({"token": token.hex(), "remote_block_ids": remote_ids,
                       "layer_starts": list(layer_starts)}).encode()
    return len(head).to_bytes(4, "big") + head + bytes(notification)


def decode_write(body: bytes) -> tuple[bytes, object, object, bytes]:
    """Inverse of ``encode_write``: (token, remote block ids and layer starts as sent,
    notification)."""
    size = int.from_bytes(body[:4], "big")
    head = json.loads(body[4:4 + size])
    return (bytes.fromhex(str(head.get("token", ""))), head.get("remote_block_ids"),
            head.get("layer_starts"), body[4 + size:])


def call_agent(agent, what: str, method: str, *args, quiet: bool = False):
    """``agent.<method>(*args)``; raises KVTransferError naming ``what`` (or logs it at debug
    level and returns None, when ``quiet``)."""
    try:
        return getattr(agent, method)(*args)
    except Exception as exc:  # NIXL raises its own error types; the agent is None if closed
        if not quiet:
            raise KVTransferError(f"NIXL {what} failed: {exc!r}") from exc
        logger.debug("NIXL %s failed: %r", what, exc)
        return None


def release_xfer(agent, xfer, deadline: float, poll_s: float) -> None:
    """Release a WRITE's handle once NIXL is done with it, or at ``deadline`` (monotonic)."""
    while (time.monotonic() < deadline
           and call_agent(agent, "checking a WRITE", "check_xfer_state", xfer, quiet=True) == "PROC"):
        time.sleep(poll_s)
    call_agent(agent, "releasing a WRITE", "release_xfer_handle", xfer, quiet=True)


def agent_metadata(hello: dict) -> bytes:
    """The NIXL agent metadata a handshake carries (base64 in ``hello["agent_md"]``)."""
    return base64.b64decode(hello["agent_md"], validate=True)
