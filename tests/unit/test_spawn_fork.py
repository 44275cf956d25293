"""Children spawned while gRPC is busy start cleanly: gRPC's fork handlers are off
(``services/__init__.py``; grpc/grpc#43055 aborted such a child before ``exec``)."""
from __future__ import annotations

import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest

from services.runtime.process import spawn


def _exit_code(child: subprocess.Popen) -> int | None:
    """The child's exit status, or None when it has not exited in 30 s (then it is killed)."""
    try:
        return child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return None


@pytest.mark.timeout(180)  # with the handlers on, a fork was also seen to hang here
def test_spawn_runs_no_grpc_fork_handler_while_grpc_is_busy(capfd):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()

    def busy() -> None:  # keeps gRPC's poller and executor threads working during every fork
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/tandem.test.Nothing/Here")
            while not stop.is_set():
                try:
                    call(b"", timeout=0.05)
                except grpc.RpcError:
                    pass

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        codes = [_exit_code(spawn([sys.executable, "-c", "pass"], {})) for _ in range(40)]
    finally:
        stop.set()
        thread.join(5)
        server.stop(None)
    err = capfd.readouterr().err
    # with the handlers on, gRPC logs this on about half of these forks (and rarely aborts one)
    assert "fork() handlers" not in err and "epoll_wait error" not in err, err[-2000:]
    assert codes == [0] * 40
