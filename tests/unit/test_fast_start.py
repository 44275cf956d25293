"""A worker's start does no avoidable work: building the model (quantized or float32) and
warming the engine import neither ``torch._dynamo`` nor sympy (entering a
``torch.device("meta")`` context, or initialising a meta tensor with ``normal_``, imported
~900 modules: seconds of every start), and quantized weights stay in the memory-mapped file."""
from __future__ import annotations

import subprocess
import sys

CODE = """
import sys, torch
from services.engine.engine import EngineConfig, LLMEngine
assert "torch._dynamo" not in sys.modules and "sympy" not in sys.modules, "imported by torch"
for q in ("auto", "none"):
    e = LLMEngine(EngineConfig(quantization=q, num_kv_blocks=8))
    e.warm_up()
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""


def test_engine_start_imports_no_compiler_stack():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]


def test_quantized_blocks_are_read_in_place_from_the_memory_map():
    from services.engine.quantized_loader import _reader, load_gguf_quantized
    from services.engine.model_files import default_model_path

    path = default_model_path()
    _, _, blocks = load_gguf_quantized(path, "q4_1")
    mapped = _reader(str(path))._map
    start = mapped.ctypes.data
    end = start + mapped.nbytes
    in_place = {name for name, w in blocks.items() if start <= w.data.data_ptr() < end}
    # every linear weight but q/k (rows reordered from llama.cpp's rotary layout: one copy)
    # and the embedding/LM head are views of the file's pages
    copied = {n for n in blocks if n not in in_place}
    assert copied == {n for n in blocks if n.endswith(("q_proj.weight", "k_proj.weight"))}
