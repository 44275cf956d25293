"""A decode worker process survives what killed engine threads (issue 10, finding 1): the poison
request gets INVALID_ARGUMENT, a request that raises inside the engine (fault injection) fails
alone while 8 concurrent greedy streams finish exactly as transformers does, every block comes
back; and an engine that cannot continue takes its worker out: health NOT_SERVING within one
heartbeat, out of the registry, streams UNAVAILABLE, exit status ``EXIT_ENGINE_DIED``. A worker
whose gRPC port stops accepting connections (its listening socket shut down under gRPC, as
gRPC's own acceptor does on an accept4 error) takes itself out too: it finishes the stream open
on its old connection, leaves the registry and exits with ``EXIT_LISTENER_LOST``."""
from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api import worker_pb2, worker_pb2_grpc
from services.runtime.serve import EXIT_ENGINE_DIED, EXIT_LISTENER_LOST
from tests.integration.conftest import free_port
from tests.reference import CHAT_PROMPTS, NUM_TOKENS, chat_prompt_ids, hf_greedy_outputs

DECODE = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
STARTUP_S = 300  # loading the model on a shared 2-core machine


@dataclass
class Worker:
    worker_id: str
    proc: subprocess.Popen
    channel: grpc.Channel
    port: int

    @property
    def stub(self) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channel)

    def health(self) -> int | None:
        """The DecodeWorker service's health status; None when the process does not answer."""
        try:
            return health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=DECODE), timeout=5).status
        except grpc.RpcError:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.channel.close()


def start_worker(redis_url: str, worker_id: str, heartbeat_s: float) -> Worker:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.runtime.cli", "serve", "decode", "--redis-url", redis_url,
         "--port", str(port), "--worker-id", worker_id, "--heartbeat-s", str(heartbeat_s),
         "--num-threads", "1", "--kv-cache-gib", "0.25"],
        env={**os.environ, "TANDEM_TEST_FAULT_INJECTION": "1"})
    worker = Worker(worker_id, proc, grpc.insecure_channel(f"127.0.0.1:{port}"), port)
    deadline = time.monotonic() + STARTUP_S
    while worker.health() != SERVING:
        assert proc.poll() is None, f"worker exited with {proc.returncode} while starting"
        assert time.monotonic() < deadline, "worker not SERVING in time"
        time.sleep(0.2)
    return worker


def decode(worker: Worker, rid: str, prompt: list[int], **params) -> list[int]:
    """Run a Decode stream with a local prefill; the tokens, or the RpcError raised."""
    sp = worker_pb2.SamplingParams(**{"max_tokens": NUM_TOKENS, "temperature": 0,
                                      "ignore_eos": True, "top_p": 1.0,
                                      "repetition_penalty": 1.0, **params})
    req = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                                   local_prefill=True)
    return [t for msg in worker.stub.Decode(req, timeout=STARTUP_S) for t in msg.token_ids]


def wait_all_blocks_free(worker: Worker) -> None:
    deadline = time.monotonic() + 10
    while True:
        load = worker.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        if load.free_kv_blocks == load.total_kv_blocks:
            return
        assert time.monotonic() < deadline, f"{load.total_kv_blocks - load.free_kv_blocks} used"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def worker(redis_server):
    w = start_worker(redis_server.url, "decode-poison", heartbeat_s=0.5)
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [chat_prompt_ids(p) for p in CHAT_PROMPTS]


def test_the_poison_request_gets_invalid_argument_and_the_worker_keeps_serving(worker, prompts):
    for params, field in [({"stop_token_ids": [50000], "min_tokens": 1}, "stop_token_ids"),
                          ({"temperature": float("inf")}, "temperature"),
                          ({"top_p": float("nan")}, "top_p")]:
        with pytest.raises(grpc.RpcError) as info:
            decode(worker, f"poison-{field}", prompts[0], max_tokens=8, **params)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(field)
    assert worker.health() == SERVING
    assert decode(worker, "after-poison", prompts[0]) == list(hf_greedy_outputs()[0])
    wait_all_blocks_free(worker)


def test_a_request_that_raises_in_the_engine_fails_alone(worker, prompts):
    bad = "bad+raise_in_step=3"
    with ThreadPoolExecutor(9) as pool:
        streams = [pool.submit(decode, worker, f"ok-{i}", p) for i, p in enumerate(prompts[:8])]
        failed = pool.submit(decode, worker, bad, prompts[0])
        with pytest.raises(grpc.RpcError) as info:
            failed.result()
        assert [s.result() for s in streams] == [list(r) for r in hf_greedy_outputs()[:8]]
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "injected fault: raise_in_step" in info.value.details()
    assert worker.health() == SERVING
    wait_all_blocks_free(worker)


def test_an_engine_that_cannot_continue_takes_its_worker_out(redis_server, prompts):
    heartbeat_s = 1.0
    w = start_worker(redis_server.url, "decode-crash", heartbeat_s=heartbeat_s)
    r = redis.Redis.from_url(redis_server.url)
    try:
        deadline = time.monotonic() + 10
        while not r.exists("worker:decode:decode-crash"):  # its first heartbeat
            assert time.monotonic() < deadline, "never registered"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as info:
            decode(w, "crash+crash_engine=1", prompts[0])
        died_at = time.monotonic()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "crash_engine" in info.value.details()
        while w.health() == SERVING:  # NOT_SERVING, or no answer at all once it has exited
            assert time.monotonic() - died_at < heartbeat_s, "still SERVING after a heartbeat"
            time.sleep(0.02)
        assert w.proc.wait(60) == EXIT_ENGINE_DIED
        assert not r.exists("worker:decode:decode-crash")
        assert b"decode-crash" not in r.smembers("workers:decode")
    finally:
        r.close()
        w.stop()


_SYS_PIDFD_OPEN, _SYS_PIDFD_GETFD = 434, 438  # x86_64 and aarch64 (Linux >= 5.6)


def shut_down_listener(pid: int, port: int) -> None:
    """``shutdown()`` the socket process ``pid`` listens on ``port`` with, from outside: its
    gRPC acceptor then fails accept4 and closes, and connections are refused while the
    process runs on (``services.runtime.serve.watch_listener``'s case). Skips the test when
    the kernel does not lend us the descriptor (pidfd_getfd: Linux >= 5.6, ptrace rights)."""
    inodes = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                    inodes.add(fields[9])
    fds = [int(fd) for fd in os.listdir(f"/proc/{pid}/fd")
           if os.readlink(f"/proc/{pid}/fd/{fd}") in {f"socket:[{i}]" for i in inodes}]
    assert fds, f"process {pid} holds no socket listening on port {port}"
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = libc.syscall(_SYS_PIDFD_OPEN, pid, 0)
    mine = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fds[0], 0) if pidfd >= 0 else -1
    if mine < 0:
        pytest.skip(f"pidfd_getfd refused here: {os.strerror(ctypes.get_errno())}")
    os.close(pidfd)
    with socket.socket(fileno=mine) as s:
        s.shutdown(socket.SHUT_RDWR)


def test_a_worker_whose_port_refuses_connections_finishes_its_stream_and_exits(redis_server, prompts):
    heartbeat_s = 0.5
    w = start_worker(redis_server.url, "decode-deaf", heartbeat_s=heartbeat_s)
    r = redis.Redis.from_url(redis_server.url)
    try:
        sp = worker_pb2.SamplingParams(max_tokens=128, temperature=0, ignore_eos=True, top_p=1.0,
                                       repetition_penalty=1.0)
        stream = w.stub.Decode(worker_pb2.DecodeRequest(
            request_id="open-stream", prompt_token_ids=prompts[0], sampling_params=sp,
            local_prefill=True), timeout=STARTUP_S)
        tokens = list(next(stream).token_ids)  # the stream runs on the open connection
        shut_down_listener(w.proc.pid, w.port)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", w.port), timeout=5).close()
        for msg in stream:  # the worker drains: the open stream runs to its end
            tokens += msg.token_ids
        assert len(tokens) == 128
        assert w.proc.wait(60) == EXIT_LISTENER_LOST
        assert not r.exists("worker:decode:decode-deaf")
    finally:
        r.close()
        w.stop()
