"""The checked-in gRPC stubs are exactly what protoc generates from proto/ now."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.api.generate import REPO


def test_generated_stubs_are_current(tmp_path: Path) -> None:
    # NOTE: protoc runs in its own process: in-process after the stubs were imported (by other
    # tests) it shares protobuf's descriptor pool and was seen to crash the interpreter.
    subprocess.run([sys.executable, "-m", "services.api.generate", str(tmp_path)], check=True, timeout=120)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert fresh, "protoc produced nothing"
    stale = [str(rel) for rel in fresh if (REPO / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, f"stale stubs, run `python -m services.api.generate`: {stale}"


def test_stubs_import_as_package_modules() -> None:
    from services.api import gateway_pb2, gateway_pb2_grpc, worker_pb2_grpc

    assert gateway_pb2.DESCRIPTOR.package == "tandem.v1"
    assert hasattr(gateway_pb2_grpc, "GatewayStub")
    assert hasattr(worker_pb2_grpc, "DecodeWorkerStub") and hasattr(worker_pb2_grpc, "PrefillWorkerStub")
