"""A real stack for integration tests: gateway + prefill + decode processes on 127.0.0.1,
sharing the session's throwaway redis-server."""
from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from services.launcher import Stack, UpOptions

WORKER_ARGS = ["--num-threads", "1", "--kv-cache-gib", "0.25", "--heartbeat-s", "0.5"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(redis_server) -> Iterator[Stack]:
    s = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=1, num_decode=1,
                        redis_url=redis_server.url, worker_args=WORKER_ARGS,
                        gateway_args=["--heartbeat-s", "0.5"], ready_timeout_s=180))
    try:
        s.start()
        s.wait_ready()
        yield s
    finally:
        s.stop()
