"""Triton cache write and block gather / scatter vs the torch references."""
from __future__ import annotations

import pytest
import torch

from kernels import reference

from .conftest import DEVICE, DTYPES, HAS_CUDA

pytest.importorskip("triton", reason="triton is not installed: Triton kernels not tested")
from kernels.cache_ops import copy_blocks, gather_blocks, scatter_blocks, write_kv_cache  # noqa: E402

NUM_BLOCKS = 12 if not HAS_CUDA else 4096


def random_cache(shape, dtype):
    return torch.randn(shape).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 32), (3, 64), (2, 40)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_tokens", [1, 17])
def test_write_kv_cache_matches_reference(num_tokens, block_size, num_kv_heads, head_dim, dtype):
    shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = random_cache(shape, dtype), random_cache(shape, dtype)
    num_slots = NUM_BLOCKS * block_size
    slots = torch.randperm(num_slots)[:min(num_tokens, num_slots)].to(DEVICE)
    k = random_cache((len(slots), num_kv_heads, head_dim), dtype)
    v = random_cache((len(slots), num_kv_heads, head_dim), dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(k, v, k_expected, v_expected, slots)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def test_write_kv_cache_layer_views_and_skipped_slots():
    """The engine passes kv_cache[layer][0] / [1] views; slot -1 is skipped."""
    kv_cache = random_cache((2, 2, NUM_BLOCKS, 4, 2, 16), torch.float16)
    expected = kv_cache.clone()
    k = random_cache((3, 2, 16), torch.float16)
    v = random_cache((3, 2, 16), torch.float16)
    slots = torch.tensor([5, -1, 9], device=DEVICE)
    write_kv_cache(k, v, kv_cache[1][0], kv_cache[1][1], slots)
    keep = torch.tensor([0, 2], device=DEVICE)
    reference.write_kv_cache(k[keep], v[keep], expected[1][0], expected[1][1], slots[keep])
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead", [(), (3, 2)], ids=["layer", "whole-cache"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_gather_scatter_blocks_match_reference(block_size, lead, dtype):
    cache = random_cache((*lead, NUM_BLOCKS, block_size, 3, 40), dtype)
    ids = torch.randperm(NUM_BLOCKS)[:5].to(DEVICE)
    buffer = gather_blocks(cache, ids)
    assert torch.equal(buffer, reference.gather_blocks(cache, ids))
    target, expected = torch.zeros_like(cache), torch.zeros_like(cache)
    scatter_blocks(buffer, target, ids)
    reference.scatter_blocks(buffer, expected, ids)
    assert torch.equal(target, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead", [(), (3, 2)], ids=["layer", "whole-cache"])
def test_copy_blocks_between_caches_touches_only_the_destination_ids(lead, dtype):
    src = random_cache((*lead, NUM_BLOCKS, 4, 3, 40), dtype)
    dst = random_cache((*lead, NUM_BLOCKS + 3, 4, 3, 40), dtype)  # only num_blocks may differ
    src_ids = torch.tensor([7, 0, 3, 11], device=DEVICE)
    dst_ids = torch.tensor([2, 14, 9, 0], device=DEVICE)
    expected = dst.clone()
    expected[..., dst_ids, :, :, :] = src[..., src_ids, :, :, :]
    copy_blocks(src, dst, src_ids, dst_ids)
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))
    with pytest.raises(ValueError, match="cannot copy blocks"):
        copy_blocks(src, dst[..., :2].contiguous(), src_ids, dst_ids)  # another head_dim
    with pytest.raises(ValueError, match="cannot copy blocks"):
        copy_blocks(src, dst, src_ids, dst_ids[:3])


def test_block_ops_empty_and_bad_arguments():
    cache = random_cache((NUM_BLOCKS, 4, 2, 16), torch.float32)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert gather_blocks(cache, empty).shape == (0, 4, 2, 16)
    with pytest.raises(ValueError, match="buffer"):
        scatter_blocks(torch.zeros(2, 4, 2, 8, device=DEVICE), cache,
                       torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        gather_blocks(cache.transpose(0, 1), torch.tensor([0], device=DEVICE))
