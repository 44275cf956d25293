"""Kernel-test fixtures. Without CUDA the Triton kernels run in Triton's interpreter on CPU.

NOTE: ``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set
here, before any test module imports a kernel module.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from kernels import reference

HAS_CUDA = torch.cuda.is_available()


def _shape_stable_interpreter_dot() -> None:
    """Make the interpreter's ``tl.dot`` give each output element the same bits whatever the
    operands' other rows and columns, as a GPU's does (its sum over K runs the same way in a
    tile of any size). The interpreter's own ``np.matmul`` goes to OpenBLAS, whose kernel (and
    order of the K sum) depends on the matrix shape and on the CPU: with OpenBLAS's Haswell
    kernel (AVX2 CPUs, and CPUs it does not know) a query tile of 8 rows and one of 16 gave a
    row different float32 bits, and the bit-equality tests of a kernel's padding and grid failed
    on those CPUs alone. Here the products are summed along a contiguous K axis (numpy's
    pairwise sum), which depends on K alone."""
    try:
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError:  # no triton: the kernel tests skip
        return
    matmul = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating():
            return matmul(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        products = a.data.astype(acc)[:, None, :] * b.data.astype(acc).T[None, :, :]
        return type(d)(products.sum(axis=2, dtype=acc) + d.data, d.dtype.scalar)

    InterpreterBuilder.create_dot = create_dot


if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _shape_stable_interpreter_dot()

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# max |kernel - float32 reference| for outputs of magnitude ~1; bf16 also covers the
# interpreter's truncating float32 -> bfloat16 conversion; CUDA runs longer contexts
ATOL = {torch.float32: 1e-4 if HAS_CUDA else 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
GARBAGE = 1000.0  # fills cache slots no sequence owns: a masking bug shows up loudly


@dataclass
class PagedBatch:
    """A ragged batch over a paged cache, plus each sequence's dense K/V for checking."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor  # [num_seqs] int64
    query_start_loc: list[int]  # num_seqs + 1
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    scale: float

    @property
    def max_query_len(self) -> int:
        locs = self.query_start_loc
        return max(b - a for a, b in zip(locs, locs[1:]))

    def query_start_loc_tensor(self) -> torch.Tensor:
        return torch.tensor(self.query_start_loc, dtype=torch.int32, device=self.q.device)


def make_paged_batch(
    seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype = torch.float32, device: torch.device = DEVICE,
    seed: int = 0,
) -> PagedBatch:
    """``seqs``: ``(cached_prefix_len, query_len)`` per sequence, in batch order. Blocks are
    handed out in shuffled order; every slot no sequence owns holds ``GARBAGE``."""
    gen = torch.Generator().manual_seed(seed)
    lens = [ctx + n for ctx, n in seqs]
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, GARBAGE, dtype=dtype)
    v_cache = torch.full(shape, -GARBAGE, dtype=dtype)
    tables, keys, values, queries = [], [], [], []
    for (ctx, n), seq_len, nb in zip(seqs, lens, blocks_per_seq):
        table, order = order[:nb], order[nb:]
        tables.append(table + [0] * (max(blocks_per_seq) - nb))  # padded with 0, like the engine
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor([table[i // block_size] * block_size + i % block_size
                              for i in range(seq_len)], dtype=torch.int64)
        reference.write_kv_cache(k, v, k_cache, v_cache, slots)
        keys.append(k.to(device))
        values.append(v.to(device))
        queries.append(torch.randn(n, num_heads, head_dim, generator=gen).to(dtype))
    locs = [0]
    for _, n in seqs:
        locs.append(locs[-1] + n)
    return PagedBatch(
        torch.cat(queries).to(device), k_cache.to(device), v_cache.to(device),
        torch.tensor(tables, dtype=torch.int64, device=device),
        torch.tensor(lens, dtype=torch.int64, device=device), locs, keys, values,
        head_dim**-0.5)


def reference_in_float32(fn, batch: PagedBatch, *args) -> torch.Tensor:
    """``fn(q, k_cache, v_cache, *args)`` of a reference on float32 copies of the batch."""
    return fn(batch.q.float(), batch.k_cache.float(), batch.v_cache.float(), *args)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return DEVICE
