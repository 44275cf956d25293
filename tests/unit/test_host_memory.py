"""The engine's large host buffers (``services/engine/host_memory.py``): the CPU KV cache is zeros
the kernel maps lazily (equal to ``torch.zeros``, writable, not resident until touched), and it
and the packed quantized weights are 2 MiB-aligned maps advised for huge pages."""
from __future__ import annotations

import os

import pytest
import torch

from services.engine.engine import EngineConfig, LLMEngine
from services.engine.host_memory import HUGE_PAGE, mapped_zeros, zeroed_kv_cache
from services.engine.quantized import QuantEmbedding, QuantLinear, pack_resident_blocks


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
    assert t.data_ptr() % HUGE_PAGE == 0


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


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unavailable"


def _thp_eligible(address: int) -> bool:
    """Whether the kernel may back the map holding ``address`` with huge pages
    (``THPeligible`` of its /proc/self/smaps entry)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    raise AssertionError(f"no smaps entry holds {address:#x}")


def test_mapped_zeros_is_aligned_exact_and_advised_for_huge_pages():
    t = mapped_zeros(3 * HUGE_PAGE + 5)
    assert t.dtype == torch.uint8 and t.numel() == 3 * HUGE_PAGE + 5 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0 and t.count_nonzero().item() == 0
    if _thp_mode() in ("always", "madvise"):
        assert _thp_eligible(t.data_ptr())
    with pytest.raises(ValueError, match="^nbytes"):
        mapped_zeros(-1)


def test_engine_weights_are_packed_in_one_advised_map_in_module_order():
    """Every quantized weight of the built-in model lies in one buffer, 64-byte aligned, in
    module order (the layers', then the LM head's: a forward pass's order), the tied embedding
    reading the LM head's tiles; a model with none packs 0."""
    e = LLMEngine(EngineConfig(dtype="auto", quantization="auto", num_kv_blocks=16))
    model = e.runner.model
    parts = [p for m in model.modules() if isinstance(m, QuantLinear) for p in m.parts]
    embed = next(m for m in model.modules() if isinstance(m, QuantEmbedding))
    assert embed.qweight is model.lm_head.parts[0] is parts[-1]
    starts = [p.data.data_ptr() for p in parts]
    assert all(a % 64 == 0 for a in starts) and starts == sorted(starts)
    base = starts[0]
    assert base % HUGE_PAGE == 0
    assert starts[-1] + parts[-1].data.numel() - base < sum(p.data.numel() + 64 for p in parts)
    if _thp_mode() in ("always", "madvise"):
        assert _thp_eligible(base)
    assert pack_resident_blocks(torch.nn.Linear(4, 4)) == 0
