"""The CPU KV cache is zeros the kernel maps lazily (``services/engine/kv_alloc.py``): equal
to ``torch.zeros``, writable, and not resident until touched."""
from __future__ import annotations

import os

import pytest
import torch

from services.engine.engine import EngineConfig, LLMEngine
from services.engine.kv_alloc import zeroed_kv_cache


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeroed_kv_cache_is_zeros_and_writable(dtype):
    t = zeroed_kv_cache((2, 2, 8, 16, 3, 64), dtype)
    assert t.shape == (2, 2, 8, 16, 3, 64) and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, torch.zeros_like(t))
    t[1, 0, 5] = 1.5
    assert t[1, 0, 5].eq(1.5).all() and t.sum().item() == 1.5 * 16 * 3 * 64
    assert t.data_ptr() % 4096 == 0  # page-aligned


def test_zeroed_kv_cache_is_not_resident_until_touched():
    before = _rss_bytes()
    t = zeroed_kv_cache((64, 2**20), torch.float32)  # 256 MiB
    assert _rss_bytes() - before < 32 * 2**20
    t[0].fill_(1.0)  # one 4 MiB row becomes resident
    assert t[0].sum().item() == 2**20 and t[1].abs().sum().item() == 0


def test_zeroed_kv_cache_rejects_a_negative_dimension():
    with pytest.raises(ValueError, match="^shape"):
        zeroed_kv_cache((2, -1), torch.float32)


def test_engine_kv_cache_starts_zeroed_and_serves():
    e = LLMEngine(EngineConfig(quantization="auto", num_kv_blocks=16))
    assert torch.equal(e.kv_cache, torch.zeros_like(e.kv_cache))
    e.warm_up()  # a prefill and a decode step write and read the mapped cache
    assert e.kv_cache.abs().sum().item() > 0
