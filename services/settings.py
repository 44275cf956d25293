"""Every environment variable Tandem reads, declared once with its type and default.

Command-line flags take their defaults from these, so ``--port`` and ``TANDEM_PORT`` set the
same thing. Library code never reads ``os.environ`` itself and holds no literal host or port.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"environment variable {self.name}={raw!r}: {exc}") from exc


def _opt_str(raw: str) -> str | None:
    return raw or None


REDIS_URL = EnvVar("REDIS_URL", None, _opt_str, "Redis for request state and the worker registry")
HOST = EnvVar("TANDEM_HOST", "127.0.0.1", str, "address services listen on")
ADVERTISE_HOST = EnvVar("TANDEM_ADVERTISE_HOST", None, _opt_str,
                        "address peers use to reach this worker (default: --host)")
GATEWAY_PORT = EnvVar("TANDEM_PORT", 50051, int, "gateway gRPC port")
WORKER_PORT = EnvVar("TANDEM_WORKER_PORT", 0, int, "worker gRPC port (0: any free port)")
KV_PORT = EnvVar("TANDEM_KV_PORT", 0, int, "KV transfer listen port (0: any free port)")
MODEL = EnvVar("TANDEM_MODEL", None, _opt_str, "GGUF file or Hugging Face directory")
KV_TRANSPORT = EnvVar("TANDEM_KV_TRANSPORT", "tcp", str, "KV transfer backend")
KV_CACHE_GIB = EnvVar("TANDEM_KV_CACHE_GIB", 1.0, float, "KV cache memory per worker, GiB")
NUM_THREADS = EnvVar("TANDEM_NUM_THREADS", 1, int, "torch threads per worker process")
HEARTBEAT_S = EnvVar("TANDEM_HEARTBEAT_S", 1.0, float, "worker registry heartbeat, seconds")
KV_LEASE_S = EnvVar("TANDEM_KV_LEASE_S", 30.0, float, "seconds a KV reservation waits for its KV")
RPC_TIMEOUT_S = EnvVar("TANDEM_RPC_TIMEOUT_S", 600.0, float, "deadline of internal RPCs, seconds")
LOG_LEVEL = EnvVar("TANDEM_LOG_LEVEL", "INFO", str, "logging level")
