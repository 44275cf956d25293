"""Framing for the TCP KV transport: length-prefixed JSON frames, zero-copy scatter/gather
socket I/O with deadlines (``sendmsg`` / ``recvmsg_into`` over lists of memoryviews), and a
write's payload: views of a CPU cache's blocks, or one host copy staged from a device cache.

A cache on a GPU cannot be a socket buffer: it is staged through host memory. The sender
gathers the blocks on the device (``gather_blocks``, the Triton kernel on CUDA) and sends one
host copy; the receiver fills a host buffer and scatters it into its cache. The wire is the
same, so a GPU worker and a CPU worker interoperate."""
from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Sequence

import torch

from kernels.block_copy import gather_blocks, scatter_blocks
from services.kv_transfer.block_ids import block_runs

_LEN = struct.Struct("!I")
_MAX_FRAME = 64 << 20  # bytes; a header of a million block ids still fits
_IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux UIO_MAXIOV)


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _move(sock: socket.socket, views: list[memoryview], deadline: float | None, send: bool) -> None:
    """Send all of ``views``, or fill them in order, by ``deadline`` (None: no limit)."""
    views, i = [v for v in views if len(v)], 0
    while i < len(views):
        sock.settimeout(None if deadline is None else remaining(deadline))
        batch = views[i:i + _IOV_MAX]
        nbytes = sock.sendmsg(batch) if send else sock.recvmsg_into(batch)[0]
        if nbytes == 0:
            raise ConnectionError("connection closed by peer")
        while nbytes:  # skip the finished views, trim a partly done one
            done = min(nbytes, len(views[i]))
            views[i], nbytes = views[i][done:], nbytes - done
            if len(views[i]) == 0:
                i += 1


def recv_into(sock: socket.socket, views: list[memoryview], deadline: float | None) -> None:
    _move(sock, views, deadline, send=False)


def discard(sock: socket.socket, nbytes: int, deadline: float) -> None:
    """Read and drop ``nbytes``, keeping the stream in step after a refused write."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
    while nbytes:
        chunk = min(nbytes, len(scratch))
        recv_into(sock, [scratch[:chunk]], deadline)
        nbytes -= chunk


def send_frame(sock: socket.socket, obj: dict, deadline: float, extra: Sequence = ()) -> None:
    body = json.dumps(obj).encode()
    _move(sock, [memoryview(_LEN.pack(len(body))), memoryview(body), *extra], deadline, True)


def recv_frame(sock: socket.socket, deadline: float | None, body_timeout_s: float = 0.0) -> dict:
    """Read one frame by ``deadline``; with None, wait forever for it to start, then allow
    ``body_timeout_s`` seconds for the rest. Raises OSError or ValueError on a bad frame."""
    head = bytearray(_LEN.size)
    recv_into(sock, [memoryview(head)], deadline)
    (size,) = _LEN.unpack(head)
    if size > _MAX_FRAME:
        raise ConnectionError(f"frame of {size} bytes exceeds {_MAX_FRAME}")
    body = bytearray(size)
    recv_into(sock, [memoryview(body)], deadline or time.monotonic() + body_timeout_s)
    obj = json.loads(body)
    if not isinstance(obj, dict):
        raise ConnectionError("frame is not a JSON object")
    return obj


def payload_views(cache: torch.Tensor, memory: memoryview | None, block_ids: Sequence[int],
                  layer_starts: Sequence[int]) -> list[memoryview]:
    """The payload of a write of ``block_ids`` from ``cache`` (``[num_layers, 2, num_blocks,
    block_size, num_kv_heads, head_dim]``), layer ``l`` from position ``layer_starts[l]`` of
    the list on: views of ``memory`` (its flat bytes), or, when ``memory`` is None (a device
    cache), one host copy gathered on the device."""
    if memory is not None:
        return _regions(cache, memory, block_ids, layer_starts)
    if not any(layer_starts):
        return [as_bytes(gather_blocks(cache, _index(cache, block_ids)).cpu())]
    index = _index(cache, block_ids)
    return [as_bytes(gather_blocks(cache[layer], index[start:]).cpu())
            for layer, start in enumerate(layer_starts) if start < len(block_ids)]


def recv_payload(sock: socket.socket, cache: torch.Tensor, memory: memoryview | None,
                 block_ids: Sequence[int], layer_starts: Sequence[int], deadline: float) -> None:
    """Fill ``block_ids`` of ``cache`` (layer ``l`` from position ``layer_starts[l]`` on) from
    the socket by ``deadline``: straight into ``memory``, or (None) through host buffers
    scattered on the device."""
    if memory is not None:
        recv_into(sock, _regions(cache, memory, block_ids, layer_starts), deadline)
        return
    index = _index(cache, block_ids)
    if not any(layer_starts):
        buffer = torch.empty((*cache.shape[:2], len(block_ids), *cache.shape[3:]),
                             dtype=cache.dtype)
        recv_into(sock, [as_bytes(buffer)], deadline)
        scatter_blocks(buffer.to(cache.device), cache, index)
        return
    buffers = [(layer, start, torch.empty((2, len(block_ids) - start, *cache.shape[3:]),
                                          dtype=cache.dtype))
               for layer, start in enumerate(layer_starts) if start < len(block_ids)]
    recv_into(sock, [as_bytes(b) for _, _, b in buffers], deadline)
    for layer, start, buffer in buffers:
        scatter_blocks(buffer.to(cache.device), cache[layer], index[start:])


def _index(cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.int64, device=cache.device)


def _regions(cache: torch.Tensor, memory: memoryview, block_ids: Sequence[int],
             layer_starts: Sequence[int]) -> list[memoryview]:
    """Views of a CPU cache in payload order: layer, K then V, runs of the layer's ids."""
    num_layers, _, num_blocks = cache.shape[:3]
    size = cache[0, 0, 0].numel() * cache.element_size()  # one block of one layer's K or V
    views = []
    for region in range(num_layers * 2):  # (layer, K/V) in order
        base = region * num_blocks
        views += [memory[(base + first) * size:(base + first + n) * size]
                  for first, n in block_runs(block_ids[layer_starts[region // 2]:])]
    return views
