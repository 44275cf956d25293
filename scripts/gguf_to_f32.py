"""Write an F32 copy of a GGUF file: every tensor dequantized to float32, metadata unchanged.

The F32 rows of the single-stream comparison (``llama-server`` on F32 weights against Tandem's
``f32`` path, docs/benchmarks.md) and the F32 oracle test need such a file; none ships in a
package. gguf-py (llama.cpp's own reader, writer and dequantizers) does the work, so the tensors
are exactly ``gguf.quants.dequantize`` of the source's and in llama.cpp's layout (q/k rows in
its rotary order, as the source has them).

    python -m scripts.gguf_to_f32 [SRC] DST     # SRC: the built-in model when left out

Raises ``FileNotFoundError`` for a missing source and ``ValueError`` for a tensor type gguf-py
cannot dequantize.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np


def _copy_fields(reader, writer) -> None:
    from gguf import GGUFValueType

    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            strings = field.types[1] == GGUFValueType.STRING
            writer.add_array(name, [bytes(field.parts[i]).decode() if strings
                                    else field.parts[i].tolist()[0] for i in field.data])
        elif kind == GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], kind)


def write_f32_copy(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write ``dst``: ``src`` with every tensor as float32 (same names, shapes and metadata).
    Returns ``dst`` as a ``Path``."""
    from gguf import GGUFReader, GGUFWriter
    from gguf.quants import dequantize

    if not Path(src).is_file():
        raise FileNotFoundError(f"GGUF file {src} does not exist")
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"]
    writer = GGUFWriter(str(dst), bytes(arch.parts[arch.data[0]]).decode())
    _copy_fields(reader, writer)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order: [out, in]
        writer.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float32)
                          .reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def main(argv: list[str] | None = None) -> None:
    from services.engine.model_files import default_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", metavar="[SRC] DST")
    args = p.parse_args(argv)
    if len(args.paths) > 2:
        p.error("at most two paths: [SRC] DST")
    src, dst = (args.paths if len(args.paths) == 2 else (default_model_path(), args.paths[0]))
    out = write_f32_copy(src, dst)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
