"""Paged attention for CPUs: a small C kernel (``csrc/paged_decode_attention.c``, OpenMP)
that reads each sequence's K/V in place from the paged cache, for decode steps and prefill
chunks alike (one query token at a time).

The torch reference (``reference.paged_decode_attention``) has to gather every sequence's
blocks into a padded copy before SDPA can run: at a decode batch of 64 on this project's 2-core
CPU the gathers alone were 19% of a step. The kernel reads each K/V row once, for all the query
heads that share it. vLLM's CPU backend does the same with its own C++ kernels.

Batch invariance: a query's output depends only on its q, its context length and the cache, in
one order of sums, whatever else is in the call and on any thread count; a prompt's token gets
the same bits computed in a prefill chunk (of any size, after any cached prefix) as in a decode
step (the kernel's header says how).

The kernel is built on first use with the system C compiler (``$CC``, else ``cc``/``gcc``),
``-O3 -march=native -fopenmp``, into
``$TANDEM_CACHE_DIR/kernels`` (default ``~/.cache/tandem/kernels``), keyed by a hash of the
source, the flags and the CPU; later processes load the cached library. Without a compiler, or
if the build fails, ``paged_decode_attention`` falls back to the torch reference and logs why
once. It runs float32 CPU tensors, or float32 queries over a float16 cache (``KV_DTYPES``);
anything else takes the reference too. OpenMP threads:
``torch.get_num_threads()``; the library links ``libgomp.so.1``, so in a process that imported
torch it shares torch's OpenMP runtime (one thread pool, no oversubscription).

Where a library prebuilt for this CPU's family exists (the image ships them; ``kernels.native``),
it is loaded instead and nothing is compiled.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kernels import native, reference

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.c"
# NOTE: no -ffast-math: it lets the compiler reorder sums (two copies of one reduction could then
# round differently, and a row would depend on which copy ran it); the kernels write their own
# vectorised exp (csrc/vec_math.h) instead of relying on -ffast-math to vectorise expf
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c11")
LDFLAGS = ("-shared", "-fopenmp")
_ERRORS = {1: "a block table entry is outside the KV cache", 2: "a sequence length is outside "
           "1..(block_table columns x block_size)", 3: "out of memory for the split context's parts",
           4: "a query's sequence is not a row of block_tables"}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# the cache element types the C kernel reads (queries and outputs are float32): its function
KV_DTYPES = {torch.float32: "tandem_paged_attention_f32",
             torch.float16: "tandem_paged_attention_f16kv"}


def cache_dir() -> Path:
    """Where kernels built here live (``kernels.native.cache_dir``)."""
    return native.cache_dir()


def build(compiler: str | None = None) -> Path:
    """The kernel's shared library (prebuilt for this CPU's family, or compiled here unless
    cached; see ``build_shared_library``). Raises ``RuntimeError`` (with the compiler's output)
    when there is neither a fitting prebuilt library nor a compiler, or the build fails."""
    return build_shared_library(SOURCE, compiler)


def build_shared_library(source: Path, compiler: str | None = None) -> Path:
    """The shared library of the C file ``source`` with ``CFLAGS``/``LDFLAGS``: the one
    prebuilt for the best CPU family this CPU runs (the image's; ``kernels.native``), else one
    compiled here (``-march=native``) and cached in ``cache_dir()`` under a hash of the source,
    the headers beside it (``csrc/*.h``), the compiler, the flags and this CPU; returns its path.
    A ``compiler`` given always compiles here.

    Raises ``RuntimeError`` (with the compiler's output) when nothing fits and no compiler is
    found or the build fails; ``OSError`` when the cache cannot be written or the library does
    not load. Safe under concurrent builds: each compiles to a temporary file and renames it.
    """
    return native.shared_library(source, CFLAGS, LDFLAGS, compiler)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first call; ``None`` (logged once) when it cannot be built."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        log.warning("CPU paged attention kernel unavailable, using the torch reference: %s", e)
        return None
    for fn in (getattr(lib, name) for name in KV_DTYPES.values()):
        fn.argtypes = [_PTR] * 8 + [_I64] * 10 + [ctypes.c_float, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the C kernel is built and loaded (building it if needed)."""
    return _library() is not None


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
    sliding_window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V.

    q: ``[num_seqs, num_heads, head_dim]``; k_cache, v_cache: ``[num_blocks, block_size,
    num_kv_heads, head_dim]``; block_tables: ``[num_seqs, max_blocks]`` int; seq_lens:
    ``[num_seqs]`` int, context length including this step's token (already in the cache).
    Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``; with
    ``sliding_window`` W only the last W positions (no block before them is read); with
    ``softcap`` c the scores become ``c * tanh(score / c)`` before the softmax. Writes and
    returns ``out`` (``[num_seqs, num_heads, head_dim]``, q's dtype; a new tensor if ``None``).

    float32 CPU tensors run the C kernel, and so do float32 q and out over a float16 cache
    (``--kv-cache-dtype float16``: each element widened exactly, the float32 kernel's sums);
    other dtypes or devices run ``reference.paged_decode_attention``. Raises ``ValueError``
    when a sequence length is outside ``1..max_blocks * block_size`` or a needed block id is
    outside the cache (checked before any memory is read).
    """
    out = torch.empty_like(q) if out is None else out
    num_seqs = q.shape[0]
    if num_seqs == 0:
        return out
    lib = _library() if _runs_in_c(q, k_cache, v_cache, out) else None
    if lib is None:
        out.copy_(reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                                   scale, sliding_window=sliding_window,
                                                   softcap=softcap))
        return out
    dst = out if out.is_contiguous() else torch.empty_like(q)
    plan = AttentionPlan(block_tables, seq_lens, q.shape[1], k_cache.shape[2], scale,
                         torch.get_num_threads(), sliding_window=sliding_window, softcap=softcap,
                         kv_dtype=k_cache.dtype)
    plan(q.contiguous(), k_cache, v_cache, dst)
    if dst is not out:
        out.copy_(dst)
    return out


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: list[int], scale: float,
    out: torch.Tensor | None = None, sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Prefill / chunked prefill over the paged cache, as ``reference.paged_prefill_attention``
    (same arguments: sequence ``s`` owns rows ``query_start_loc[s]:query_start_loc[s + 1]`` of
    ``q`` and ``out``, the last of its ``seq_lens[s]`` positions, already in the cache), each
    query token computed exactly as a decode step computes it (``AttentionPlan.for_tokens``).

    Runs in C as ``paged_decode_attention`` does (float32, or float32 over a float16 cache),
    others in the reference. Raises ``ValueError`` as ``paged_decode_attention`` does.
    """
    out = torch.empty_like(q) if out is None else out
    lib = _library() if _runs_in_c(q, k_cache, v_cache, out) else None
    if lib is None:
        return reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                                 query_start_loc, scale, out=out,
                                                 sliding_window=sliding_window, softcap=softcap)
    first, last = int(query_start_loc[0]), int(query_start_loc[-1])
    if last == first:
        return out
    dst = out if out.is_contiguous() else torch.empty_like(q)
    plan = AttentionPlan.for_tokens(block_tables, seq_lens, query_start_loc, q.shape[1],
                                    k_cache.shape[2], scale, torch.get_num_threads(),
                                    sliding_window, softcap, k_cache.dtype)
    plan(q[first:last].contiguous(), k_cache, v_cache, dst[first:last])
    if dst is not out:
        out[first:last].copy_(dst[first:last])
    return out


class AttentionPlan:
    """The kernel's arguments for one step's query tokens, built once and run for every layer
    (one ctypes call each, or from C: ``kernel_address``): the hot path of every step.

    block_tables: ``[num_seqs, max_blocks]`` int; context_lens: ``[num_queries]`` int, the
    cached tokens each query attends to (its position + 1); query_seq: ``[num_queries]`` int,
    each query's row of block_tables (``None``: query i is sequence i, a decode step);
    sliding_window: each query sees its last ``sliding_window`` tokens only (None: all);
    softcap: scores become ``softcap * tanh(score / softcap)`` (Gemma 2; None: as they are);
    kv_dtype: the cache's element type, float32 or float16 (``tandem_paged_attention_f16kv``).
    Validated by the kernel on each call. Raises ``RuntimeError`` when the C kernel is not
    available, ``ValueError`` for another ``kv_dtype``.
    """

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor, num_heads: int,
                 num_kv_heads: int, scale: float, num_threads: int,
                 query_seq: torch.Tensor | None = None,
                 sliding_window: int | None = None, softcap: float | None = None,
                 kv_dtype: torch.dtype = torch.float32) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError("the CPU paged attention kernel is not built (no C compiler?)")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"the CPU paged attention kernel reads float32 or float16 caches, "
                             f"not {kv_dtype}")
        self._fn = getattr(lib, KV_DTYPES[kv_dtype])
        self.tables = block_tables.to(torch.int64).contiguous()
        self.lens = context_lens.to(torch.int64).contiguous()
        self.query_seq = None if query_seq is None else query_seq.to(torch.int64).contiguous()
        self.num_queries, self.num_heads, self.num_kv_heads = self.lens.shape[0], num_heads, num_kv_heads
        self.max_len = int(self.lens.max()) if self.num_queries else 0
        self.scale, self.num_threads = scale, num_threads
        self.window, self.softcap = sliding_window or 0, softcap or 0.0
        self.scratch = torch.empty(num_threads, num_heads, self.max_len)

    @classmethod
    def for_tokens(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: list[int], num_heads: int, num_kv_heads: int, scale: float,
                   num_threads: int, sliding_window: int | None = None,
                   softcap: float | None = None,
                   kv_dtype: torch.dtype = torch.float32) -> AttentionPlan:
        """The plan of a step's rows ``query_start_loc[0]:query_start_loc[-1]``: sequence ``s``
        owns rows ``query_start_loc[s]:query_start_loc[s + 1]``, the last of its
        ``seq_lens[s]`` positions (a decode row is a chunk of one)."""
        counts = torch.diff(torch.as_tensor(query_start_loc, dtype=torch.int64))
        seq = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
        ends = torch.cumsum(counts, 0)[seq]  # each token's distance from its chunk's end
        lens = seq_lens.to(torch.int64)[seq] - (ends - torch.arange(seq.shape[0]) - 1)
        return cls(block_tables, lens, num_heads, num_kv_heads, scale, num_threads, seq,
                   sliding_window, softcap, kv_dtype)

    @property
    def kernel_address(self) -> int:
        """Address of the C function (``kernels.decode_ops`` calls it from C)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
        """q, out: contiguous float32 ``[num_queries, num_heads, head_dim]``; k_cache, v_cache:
        contiguous, the plan's ``kv_dtype``, ``[num_blocks, block_size, num_kv_heads, head_dim]``
        (not checked: the caller owns them). Raises ``ValueError`` as ``paged_decode_attention``
        does."""
        if self.num_queries == 0:
            return out
        num_blocks, block_size, _, head_dim = k_cache.shape
        query_seq = 0 if self.query_seq is None else self.query_seq.data_ptr()
        rc = self._fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), self.tables.data_ptr(),
                      query_seq, self.lens.data_ptr(), out.data_ptr(), self.scratch.data_ptr(),
                      self.num_queries, self.tables.shape[0], self.num_heads, self.num_kv_heads,
                      head_dim, num_blocks, block_size, self.tables.shape[1], self.max_len,
                      self.window, self.scale, self.softcap, self.num_threads)
        if rc != 0:
            raise ValueError(f"paged_attention: {_ERRORS.get(rc, f'error {rc}')}")
        return out


def _runs_in_c(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor) -> bool:
    return (all(t.device.type == "cpu" for t in (q, k_cache, v_cache, out))
            and q.dtype == out.dtype == torch.float32
            and k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_DTYPES
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and q.shape[1] % k_cache.shape[2] == 0)
