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


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return raw
    return parse


REDIS_URL = EnvVar("REDIS_URL", None, _opt_str, "Redis for request state and the worker registry")
HOST = EnvVar("TANDEM_HOST", "127.0.0.1", str, "address services listen on")
ADVERTISE_HOST = EnvVar("TANDEM_ADVERTISE_HOST", None, _opt_str,
                        "address peers use to reach this worker (default: --host)")
GATEWAY_PORT = EnvVar("TANDEM_PORT", 50051, int, "gateway gRPC port")
WORKER_PORT = EnvVar("TANDEM_WORKER_PORT", 0, int, "worker gRPC port (0: any free port)")
KV_PORT = EnvVar("TANDEM_KV_PORT", 0, int, "KV transfer listen port (0: any free port)")
MODEL = EnvVar("TANDEM_MODEL", None, _opt_str, "GGUF file or Hugging Face directory")
DEVICE = EnvVar("TANDEM_DEVICE", "cpu", str, "torch device of a worker's model and KV cache")
DTYPE = EnvVar("TANDEM_DTYPE", "float32", str, "model and KV dtype (float32 on CPU, bfloat16 on GPU)")
KV_TRANSPORT = EnvVar("TANDEM_KV_TRANSPORT", "tcp", str, "KV transfer backend")
KV_CACHE_GIB = EnvVar("TANDEM_KV_CACHE_GIB", 1.0, float, "KV cache memory per worker, GiB")
NUM_THREADS = EnvVar("TANDEM_NUM_THREADS", 1, int, "torch threads per worker process")
HEARTBEAT_S = EnvVar("TANDEM_HEARTBEAT_S", 1.0, float, "worker registry heartbeat, seconds")
KV_LEASE_S = EnvVar("TANDEM_KV_LEASE_S", 30.0, float,
                   "decode worker: seconds a KV reservation waits for its KV before it is freed")
KV_TRANSFER_TIMEOUT_S = EnvVar("TANDEM_KV_TRANSFER_TIMEOUT_S", 30.0, float,
                              "prefill worker: deadline of one KV write, seconds (never past the lease)")
KV_FAILURE_POLICY = EnvVar("TANDEM_KV_FAILURE_POLICY", "recompute", _choice("recompute", "fail"),
                           "gateway: when a prompt's KV transfer fails or times out, the decode "
                           "worker computes the prompt itself (recompute) or the request fails (fail)")
MAX_WAITING = EnvVar("TANDEM_MAX_WAITING", 256, int,
                     "worker: requests held outside the running batch before new ones get "
                     "RESOURCE_EXHAUSTED")
MAX_INFLIGHT = EnvVar("TANDEM_MAX_INFLIGHT", 1024, int,
                      "gateway: requests in flight before new ones get RESOURCE_EXHAUSTED")
RPC_TIMEOUT_S = EnvVar("TANDEM_RPC_TIMEOUT_S", 600.0, float, "deadline of internal RPCs, seconds")
LOG_LEVEL = EnvVar("TANDEM_LOG_LEVEL", "INFO", str, "logging level")

# TEST ONLY: never set in a deployment. Lets the integration tests inject faults per request.
TEST_FAULT_INJECTION = EnvVar(
    "TANDEM_TEST_FAULT_INJECTION", False, _bool,
    "TEST ONLY: prefill workers honour fault tags in request ids (+fail_kv_write, "
    "+kv_write_delay=S, +queue_delay=S); see services/prefill/faults.py")
