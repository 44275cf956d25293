"""Regenerate the stubs: ``python -m services.api.generate [OUT_ROOT]`` (needs grpcio-tools).

protoc's ``-I VIRTUAL=PHYSICAL`` form names each file ``services/api/<name>.proto``, so the
generated modules import each other as ``from services.api import ...`` with no path tricks.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "proto" / "tandem" / "v1"
PROTO_FILES = ("gateway.proto", "worker.proto")


def generate(out_root: Path) -> None:
    """Write ``services/api/*_pb2*.py(i)`` under ``out_root``. Raises RuntimeError on failure."""
    from grpc_tools import protoc

    args = [
        "protoc", f"-Iservices/api={PROTO_DIR}", f"--python_out={out_root}",
        f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
        *(str(PROTO_DIR / name) for name in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
