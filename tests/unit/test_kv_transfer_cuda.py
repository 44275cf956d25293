"""KV handoff between two processes on one GPU (issue 37): the TCP transport's direct writes
open the receiver's cache by CUDA IPC and copy on the device; with direct writes off the same
write is staged through host memory. Skipped without a GPU (CI); on one, the receiver is a
second process, as a decode worker is.
"""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from services.engine.config import KVCacheLayout
from services.kv_transfer import KVTransferError
from services.kv_transfer.tcp import TcpKVTransport
from tests.unit.test_kv_transfer import make_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYOUT = KVCacheLayout(num_layers=4, block_size=16, num_kv_heads=3, head_dim=64,
                       dtype="bfloat16")
TIMEOUT_S = 30.0


def cuda_cache(num_blocks: int, seed: int, device: int = 0) -> torch.Tensor:
    return make_cache(LAYOUT, num_blocks, seed).to(f"cuda:{device}")


def receiver_main(requests, replies, device: int = 0) -> None:
    """The decode side, in its own process (its cache on GPU ``device``): publishes its
    metadata, then on each request answers with its cache (on the CPU) and the notifications
    it got so far."""
    cache = cuda_cache(40, seed=2, device=device)
    transport = TcpKVTransport(cache, LAYOUT, host="127.0.0.1", port=0)
    notes: list[bytes] = []
    transport.set_notification_handler(notes.append)
    replies.put((transport.metadata(), cache.cpu()))
    while requests.get() != "stop":
        torch.cuda.synchronize()
        replies.put((cache.cpu(), list(notes)))
    transport.close()


@pytest.fixture(params=[0])
def receiver(request):
    """The receiver process, its cache on GPU ``request.param`` (indirect: another GPU)."""
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver_main, args=(requests, replies, request.param),
                       daemon=True)
    proc.start()
    metadata, initial = replies.get(timeout=120)

    def state():
        requests.put("state")
        return replies.get(timeout=60)

    yield proc, metadata, initial, state
    if proc.is_alive():
        requests.put("stop")
        proc.join(timeout=30)
        proc.kill()


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.parametrize("receiver, direct", [
    (0, True), (0, False),
    pytest.param(1, True, marks=TWO_GPUS),  # a peer's cache on another GPU of the node
], ids=["cuda-ipc", "host-staged", "cuda-ipc-other-gpu"], indirect=["receiver"])
def test_blocks_land_bit_exact_in_another_process(receiver, direct):
    proc, metadata, initial, state = receiver
    src = cuda_cache(24, seed=1)
    sender = TcpKVTransport(src, LAYOUT, host="127.0.0.1", port=0, direct_writes=direct)
    try:
        peer = sender.add_remote(metadata)
        assert sender.direct_peers() == ([peer] if direct else [])
        expected = initial.clone()
        local, remote = [19, 3, 7, 8, 9, 0], [2, 12, 0, 1, 4, 39]
        sent = sender.write_blocks(peer, local, remote, b"req-1", TIMEOUT_S)
        expected[:, :, remote] = src.cpu()[:, :, local]
        # a sliding-window model's layers keep fewer blocks (Gemma): layer l from starts[l] on
        starts = [0, 2, 5, 1]
        sender.write_blocks(peer, [1, 2, 3, 4, 5], [20, 21, 22, 23, 24], b"req-2", TIMEOUT_S,
                            layer_starts=starts)
        for layer, start in enumerate(starts):
            expected[layer, :, [20, 21, 22, 23, 24][start:]] = src.cpu()[layer, :, [1, 2, 3, 4, 5][start:]]
        cache, notes = state()
        assert notes == [b"req-1", b"req-2"]
        assert sent == len(local) * LAYOUT.num_layers * 2 * LAYOUT.block_bytes
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    finally:
        sender.close()


def test_a_dead_receiver_fails_the_write_and_is_unmapped(receiver):
    proc, metadata, _, _ = receiver
    sender = TcpKVTransport(cuda_cache(8, seed=1), LAYOUT, host="127.0.0.1", port=0)
    try:
        peer = sender.add_remote(metadata)
        assert sender.direct_peers() == [peer]
        proc.kill()
        proc.join(timeout=30)
        with pytest.raises(KVTransferError):
            sender.write_blocks(peer, [0], [0], b"req", 5.0)
        with pytest.raises(KVTransferError):  # a fresh connection is refused: unmapped
            sender.write_blocks(peer, [0], [0], b"req", 5.0)
        assert sender.direct_peers() == []
    finally:
        sender.close()
