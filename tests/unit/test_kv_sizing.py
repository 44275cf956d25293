"""How many KV blocks a worker gets (services/engine/kv_sizing.py): on CPU a memory size (1 GiB
unless set), on a GPU the share of the device's memory left after the model and its largest
step; errors name engine.gpu_memory_utilization."""
from __future__ import annotations

import pytest

from services.engine.kv_sizing import (GIB, NON_TORCH_BYTES, DeviceMemory, blocks_for_memory,
                                      gpu_kv_cache_bytes, runtime_bytes)


def test_blocks_for_memory_is_the_floor_and_at_least_one():
    assert blocks_for_memory(1.0, 2**20) == 1024
    assert blocks_for_memory(1.0, 3 * 2**20) == 341
    assert blocks_for_memory(1e-9, 2**20) == 1


def test_the_gpu_share_less_what_the_model_needs_goes_to_the_kv_cache():
    mem = DeviceMemory(total=80 * GIB, free_at_start=79 * GIB, non_kv=3 * GIB)
    assert gpu_kv_cache_bytes(mem, 0.9) == int(80 * GIB * 0.9) - 3 * GIB
    assert gpu_kv_cache_bytes(mem, 0.5) == 37 * GIB


def test_too_little_free_memory_for_the_share_names_the_setting():
    mem = DeviceMemory(total=80 * GIB, free_at_start=40 * GIB, non_kv=GIB)
    with pytest.raises(ValueError, match=r"engine.gpu_memory_utilization: 0.9 .* only 40.0 GiB"):
        gpu_kv_cache_bytes(mem, 0.9)
    assert gpu_kv_cache_bytes(mem, 0.45) == int(80 * GIB * 0.45) - GIB  # two workers' halves


def test_a_neighbour_allocating_meanwhile_does_not_count_as_this_worker_s_runtime():
    """Measured on an H100: a decode worker started beside a prefill worker saw the device lose
    36 GiB while it profiled (the prefill worker's KV cache) and took it for its own."""
    allocated, reserved = 2 * GIB, 2 * GIB + 300 * 2**20
    alone = runtime_bytes(allocated + 400 * 2**20, allocated, reserved)
    assert alone == 400 * 2**20  # what the device lost beyond our tensors
    beside = runtime_bytes(allocated + 36 * GIB, allocated, reserved)
    assert beside == 300 * 2**20 + NON_TORCH_BYTES  # our allocator's slack + the margin
    assert runtime_bytes(allocated - GIB, allocated, reserved) == 0  # a neighbour freed memory


def test_a_model_that_does_not_fit_its_share_names_the_setting():
    mem = DeviceMemory(total=16 * GIB, free_at_start=16 * GIB, non_kv=15 * GIB)
    with pytest.raises(ValueError, match="engine.gpu_memory_utilization: 0.9 .* leaves no room"):
        gpu_kv_cache_bytes(mem, 0.9)


def test_the_cpu_engine_defaults_to_one_gib_and_honours_a_count_or_a_size():
    from services.engine.engine import EngineConfig, LLMEngine

    e = LLMEngine(EngineConfig(max_model_len=64))
    per_block = e.layout.block_bytes * 2 * e.layout.num_layers
    assert e.block_manager.num_blocks == GIB // per_block
    assert LLMEngine(EngineConfig(kv_cache_memory_gib=0.25, max_model_len=64)).block_manager.num_blocks \
        == GIB // 4 // per_block
    assert LLMEngine(EngineConfig(num_kv_blocks=7, kv_cache_memory_gib=0.25,
                                  max_model_len=64)).block_manager.num_blocks == 7
