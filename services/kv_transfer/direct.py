"""Direct KV writes: the sender copies its blocks straight into the receiver's cache.

Between two processes on one GPU (or two GPUs of one node) the receiver exports its cache
tensor once as a CUDA IPC handle (``cudaIpcGetMemHandle``, through torch's own sharing, the
mechanism of ``torch.multiprocessing`` and of UCX's ``cuda_ipc`` transport that NIXL uses on
one node); the sender opens it once per peer and each handoff is one device copy kernel, no
host staging. Within one process (a library user with two engines) the sender finds the
receiver's tensor in a registry. The control plane (handshake, grant check, notification)
stays on the transport's connection: the receiver admits a write before the sender may touch
its memory (see ``tcp``'s wire).

Trust: a sender that has opened a receiver's cache could write anywhere in it. The grant
check keeps honest senders to their reserved blocks; it is no defence against a hostile one,
which is why direct writes need the same host (``boot_id``), the internal secret's handshake
first, and are offered only by workers of one deployment.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import weakref
from collections.abc import Sequence
from functools import cache

import torch

from kernels.block_copy import copy_blocks

logger = logging.getLogger(__name__)

_IN_PROCESS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
_IN_PROCESS_LOCK = threading.Lock()


@cache
def boot_id() -> str:
    """This kernel's boot id (one per machine boot: pods of one node share it), or the
    hostname where ``/proc`` does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def device_uuid(device: torch.device) -> str:
    """The physical GPU's UUID (the same whatever ``CUDA_VISIBLE_DEVICES`` numbers it)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def export_cache(name: str, kv_cache: torch.Tensor) -> dict:
    """What a receiver publishes so that senders may write ``kv_cache`` directly: its process
    and boot, and for a CUDA cache the IPC handle of its storage (hex strings: JSON-safe).
    Registers the cache for senders in this process until ``unexport``."""
    with _IN_PROCESS_LOCK:
        _IN_PROCESS[name] = kv_cache
    info = {"pid": os.getpid(), "boot_id": boot_id(), "device": kv_cache.device.type}
    if kv_cache.is_cuda:
        storage = kv_cache.untyped_storage()
        (_, handle, size, offset, ref_handle, ref_offset, event_handle,
         event_sync) = storage._share_cuda_()
        info["ipc"] = {"uuid": device_uuid(kv_cache.device), "handle": handle.hex(),
                       "size": size, "offset": offset, "ref_handle": ref_handle.hex(),
                       "ref_offset": ref_offset, "event_handle": event_handle.hex(),
                       "event_sync": bool(event_sync), "storage_offset": kv_cache.storage_offset(),
                       "shape": list(kv_cache.shape), "dtype": str(kv_cache.dtype)}
    return info


def unexport(name: str) -> None:
    with _IN_PROCESS_LOCK:
        _IN_PROCESS.pop(name, None)


def open_peer_cache(name: str, info: object, local: torch.Tensor) -> torch.Tensor | None:
    """The peer ``name``'s cache as a tensor this process may write, from its
    ``export_cache`` info; None when no direct path exists (another host, no GPU here, the
    peer's GPU not visible, or the open failed: logged), and the write goes over the wire."""
    if not isinstance(info, dict) or info.get("boot_id") != boot_id():
        return None
    if info.get("pid") == os.getpid():
        with _IN_PROCESS_LOCK:
            return _IN_PROCESS.get(name)
    ipc = info.get("ipc")
    if not isinstance(ipc, dict) or not local.is_cuda:
        return None
    try:
        return _open_ipc(ipc, local.dtype)
    except Exception as exc:  # a failed open only costs the faster path
        logger.warning("cannot open peer %s's KV cache by CUDA IPC, staging through host "
                       "memory instead: %r", name, exc)
        return None


def _open_ipc(ipc: dict, dtype: torch.dtype) -> torch.Tensor | None:
    devices = [i for i in range(torch.cuda.device_count())
               if device_uuid(torch.device("cuda", i)) == ipc["uuid"]]
    if not devices:
        return None  # the peer's GPU is not visible to this process
    if str(dtype) != ipc["dtype"]:
        raise ValueError(f"peer cache dtype {ipc['dtype']}, ours {dtype}")
    storage = torch.UntypedStorage._new_shared_cuda(
        devices[0], bytes.fromhex(ipc["handle"]), int(ipc["size"]), int(ipc["offset"]),
        bytes.fromhex(ipc["ref_handle"]), int(ipc["ref_offset"]),
        bytes.fromhex(ipc["event_handle"]), bool(ipc["event_sync"]))
    shape = [int(x) for x in ipc["shape"]]
    cache = torch.empty(0, dtype=dtype, device=torch.device("cuda", devices[0]))
    return cache.set_(storage, int(ipc["storage_offset"]), shape)


def copy_into(local: torch.Tensor, remote: torch.Tensor, local_ids: Sequence[int],
              remote_ids: Sequence[int], layer_starts: Sequence[int]) -> None:
    """Copy ``local``'s blocks into ``remote``'s (both ``[num_layers, 2, num_blocks,
    block_size, num_kv_heads, head_dim]``), layer ``l`` from position ``layer_starts[l]`` of
    the id lists on, and wait until the bytes landed (the receiver reads them as soon as it is
    told). On one device: one copy kernel for the whole cache when every layer starts at 0;
    between two GPUs (a peer's cache opened on another device of the node): a gather, a
    device-to-device copy (peer to peer where the GPUs allow it) and a scatter."""
    src_ids = torch.tensor(local_ids, dtype=torch.int64, device=local.device)
    dst_ids = torch.tensor(remote_ids, dtype=torch.int64, device=remote.device)
    if not any(layer_starts):
        copy_blocks(local, remote, src_ids, dst_ids)
    else:
        for layer, start in enumerate(layer_starts):
            if start < len(local_ids):
                copy_blocks(local[layer], remote[layer], src_ids[start:], dst_ids[start:])
    for device in {local.device, remote.device}:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
