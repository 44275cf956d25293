"""Compile every Triton kernel for an NVIDIA GPU without one (``python -m
tests.kernels.compile_for_gpu [ARCH]``, default 90: H100/H200), through the real launch wrappers.

The kernel tests run Triton's interpreter on a CPU, which accepts code the GPU compiler refuses
(a plain Python float read as a global inside ``@triton.jit``, a shape that is not a power of
two, a dtype a ``tl.dot`` cannot take), so only a device session used to find such errors. Here
Triton's active driver is a stand-in that names the target, and ``JITFunction.run`` compiles
without launching (Triton's own ``warmup`` path): each wrapper is called as the engine calls it,
on CPU tensors, with the GPU's constexprs (``dot_options`` as for a CUDA tensor), and every
specialisation goes through Triton's whole NVIDIA pipeline (TTIR, TTGIR, LLVM, PTX, and a cubin
from the ``ptxas`` Triton ships). Outputs are never written. Prints one line per compiled kernel
and a count; exits 1 naming the case whose compile failed.

Must run in a process where ``TRITON_INTERPRET`` is unset (the kernel tests' conftest sets it
before Triton is imported): ``tests/kernels/test_compile_for_gpu.py`` starts it so.
"""
from __future__ import annotations

import os
import sys
import traceback

import torch

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("TRITON_INTERPRET is set: this compiles for the GPU, not the interpreter")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from kernels import _launch  # noqa: E402


class _CompileOnlyDriver:
    """What ``JITFunction.run`` asks the active driver before it compiles: the target, a device
    and a stream (never used: nothing launches)."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


compiled: list[str] = []
_run = JITFunction.run  # Triton's own; main() puts _compile_only in its place


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    compiled.append(f"{self.__name__}: {len(kernel.asm['cubin'])} bytes of cubin")  # or cached
    return kernel


def _gpu_dot_options(dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    return _launch.dot_options(dtype, torch.device("cuda"))


def cases():
    """(name, thunk) for each wrapper call: the built-in model's shape (9 query heads, 3 KV
    heads, head_dim 64) in bfloat16 and float32 (the GPU's serving and oracle dtypes), a
    1B-class Llama's (32 / 8 x 64) in bfloat16, and the variants that change the compiled code
    (one split or several, the fused merge, sliding window, soft-cap, Gemma's unit-offset norm,
    GeLU). Each thunk reads the loop's current values: call it before taking the next case."""
    from kernels import (cache_ops, decode_attention, layer_ops, paged_attention,
                         prefill_attention)
    for module in (decode_attention, prefill_attention):
        module.dot_options = _gpu_dot_options
    i32 = dict(dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        for heads, kv_heads in ((9, 3), (32, 8)) if dtype == torch.bfloat16 else ((9, 3),):
            d, bs, blocks = 64, 16, 64
            cache = torch.zeros(blocks, bs, kv_heads, d, dtype=dtype)
            tables = torch.zeros(4, 512 // bs, **i32)
            lens = torch.full((4,), 300, **i32)
            q = torch.zeros(4, heads, d, dtype=dtype)
            tag = f"{str(dtype)[6:]} {heads}/{kv_heads}x{d}"
            for window, cap in ((None, None), (128, None), (None, 50.0)):
                for splits, fused in ((1, False), (16, False), (16, True)):
                    yield (f"decode {tag} window={window} softcap={cap} splits={splits}"
                           f"{' fused merge' if fused else ''}",
                           lambda: decode_attention.paged_decode_attention(
                               q, cache, cache, tables, lens, 0.125, sliding_window=window,
                               softcap=cap, max_splits=splits, fused_merge=fused))
                yield (f"prefill {tag} window={window} softcap={cap}",
                       lambda: prefill_attention.paged_prefill_attention(
                           torch.zeros(40, heads, d, dtype=dtype), cache, cache, tables, lens,
                           torch.tensor([0, 10, 20, 30, 40], **i32), 10, 0.125,
                           sliding_window=window, softcap=cap))
            yield (f"mixed batch {tag}",
                   lambda: paged_attention.paged_attention(
                       torch.zeros(12, heads, d, dtype=dtype), cache, cache, tables, lens,
                       torch.tensor([0, 1, 2, 7, 12], **i32), 5, 2, 0.125))
            width = (heads + 2 * kv_heads) * d
            qkv = torch.zeros(4, width, dtype=dtype)
            table = torch.zeros(4096, d)
            slots = torch.arange(4, **i32)
            yield (f"rope_write_kv {tag}",
                   lambda: layer_ops.rope_write_kv(qkv, slots, table, table, cache, cache, slots,
                                                    heads, kv_heads))
            yield (f"qk_norm {tag}",
                   lambda: layer_ops.qk_norm(qkv, torch.ones(d, dtype=dtype),
                                             torch.ones(d, dtype=dtype), 1e-6, heads, kv_heads))
            yield (f"write_kv_cache {tag}",
                   lambda: cache_ops.write_kv_cache(torch.zeros(4, kv_heads, d, dtype=dtype),
                                                    torch.zeros(4, kv_heads, d, dtype=dtype),
                                                    cache, cache, slots))
            yield (f"copy_blocks {tag}",
                   lambda: cache_ops.copy_blocks(cache, cache, slots, slots))
        hidden, ffn = 576, 1536
        x = torch.zeros(4, hidden, dtype=dtype)
        for offset in (False, True):
            yield (f"add_rms_norm {str(dtype)[6:]} unit_offset={offset}",
                   lambda: layer_ops.add_rms_norm(x, x.clone(), torch.ones(hidden, dtype=dtype),
                                                  1e-5, unit_offset=offset))
        gate_up = torch.zeros(4, 2 * ffn, dtype=dtype)
        yield f"silu_mul {str(dtype)[6:]}", lambda: layer_ops.silu_mul(gate_up)
        yield f"gelu_tanh_mul {str(dtype)[6:]}", lambda: layer_ops.gelu_tanh_mul(gate_up)


def main(arch: int = 90) -> int:
    driver.set_active(_CompileOnlyDriver(arch))
    JITFunction.run = _compile_only
    for name, call in cases():
        before = len(compiled)
        try:
            call()
        except Exception:
            traceback.print_exc()
            print(f"FAILED: {name} (sm_{arch})")
            return 1
        for line in compiled[before:]:
            print(f"{name}: {line}")
    print(f"{len(compiled)} kernel specialisations built for sm_{arch} "
          f"(triton {triton.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90))
