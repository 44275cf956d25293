"""Internal authentication (issue 10): reading the secret, the worker-side interceptor (no or a
wrong secret: UNAUTHENTICATED before any handler runs; health stays open), and the client
channel that sends it. In-process gRPC over 127.0.0.1, no model."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api import worker_pb2, worker_pb2_grpc
from services.auth import METADATA_KEY, internal_channel, read_internal_secret
from services.rpc import create_server, mark_serving

SECRET = "internal-secret-0123456789"
SERVICE = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name


def test_secret_from_value_or_file(tmp_path):
    assert read_internal_secret(None, None) is None
    assert read_internal_secret(None, "") is None  # an empty file setting is no file
    assert read_internal_secret(f" {SECRET}\n", None) == SECRET
    path = tmp_path / "secret"
    path.write_text(f"\n{SECRET}\n")  # the whole file, stripped (not its first line)
    assert read_internal_secret(None, str(path)) == SECRET
    with pytest.raises(ValueError, match="^TANDEM_INTERNAL_SECRET_FILE: cannot read"):
        read_internal_secret(None, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="^TANDEM_INTERNAL_SECRET: .*not both"):
        read_internal_secret(SECRET, str(path))
    with pytest.raises(ValueError, match="^TANDEM_INTERNAL_SECRET: .*16 characters"):
        read_internal_secret("short", None)
    with pytest.raises(ValueError, match="^TANDEM_INTERNAL_SECRET: .*16 characters"):
        read_internal_secret(" " * 20, None)
    path.write_text("fifteen-chars!!\n")
    with pytest.raises(ValueError, match="^TANDEM_INTERNAL_SECRET_FILE: .*16 characters"):
        read_internal_secret(None, str(path))


class FakeDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Counts handler runs: a refused call must not reach one."""

    def __init__(self) -> None:
        self.calls = 0

    async def GetLoad(self, request, context):
        self.calls += 1
        return worker_pb2.WorkerLoad(worker_id="decode-fake", role="decode")

    async def Decode(self, request, context):
        self.calls += 1
        yield worker_pb2.DecodeResponse(token_ids=[7], finish_reason="length")


async def _serve(secret):
    server, health = create_server([SERVICE], secret)
    servicer = FakeDecode()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await mark_serving(health, [SERVICE])
    return server, servicer, f"127.0.0.1:{port}"


async def _codes(channel) -> list[grpc.StatusCode]:
    """Status of GetLoad and of a Decode stream on ``channel``."""
    stub, codes = worker_pb2_grpc.DecodeWorkerStub(channel), []
    for call in (lambda: stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5),
                 lambda: _drain(stub.Decode(worker_pb2.DecodeRequest(request_id="r"), timeout=5))):
        try:
            await call()
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code())
    return codes


async def _drain(call) -> list:
    return [msg async for msg in call]


def test_worker_calls_need_the_secret_and_health_stays_open():
    async def run():
        server, servicer, address = await _serve(SECRET)
        try:
            async with grpc.aio.insecure_channel(address) as plain:
                assert await _codes(plain) == [grpc.StatusCode.UNAUTHENTICATED] * 2
                health = await health_pb2_grpc.HealthStub(plain).Check(
                    health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                wrong = [(METADATA_KEY, SECRET[:-1] + "x")]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await worker_pb2_grpc.DecodeWorkerStub(plain).GetLoad(
                        worker_pb2.GetLoadRequest(), metadata=wrong, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert SECRET not in err.value.details()
            assert servicer.calls == 0  # refused before any handler ran
            async with internal_channel(address, SECRET) as authed:
                assert await _codes(authed) == [grpc.StatusCode.OK] * 2
            assert servicer.calls == 2
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_without_a_secret_workers_stay_open():
    async def run():
        server, servicer, address = await _serve(None)
        try:
            async with internal_channel(address, None) as plain:
                assert await _codes(plain) == [grpc.StatusCode.OK] * 2
        finally:
            await server.stop(None)

    asyncio.run(run())
