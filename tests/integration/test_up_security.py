"""`tandem up` exposed as a person runs it. `--api-key KEY`: the gateway child requires the key on
gRPC and HTTP (handed over in the run's private settings file, never on a command line or in a
log), and `tandem chat` sends the key it reads from TANDEM_API_KEY. `--tls-cert-file` /
`--tls-key-file`: the stack comes up and serves HTTPS and gRPC TLS."""
from __future__ import annotations

import asyncio
import ssl
import subprocess
import uuid

import grpc
import httpx
import pytest

from services.api import gateway_pb2, gateway_pb2_grpc
from tests.integration.conftest import WORKER_ARGS, free_port
from tests.integration.tls_certs import make_ca, make_leaf
from tests.integration.up_process import TANDEM, UpProcess, env_without_redis_url

pytestmark = pytest.mark.integration


def generate(address: str, key: str | None):
    async def run():
        metadata = [("authorization", f"Bearer {key}")] if key else None
        request = gateway_pb2.GenerateRequest(prompt="Paris is", max_tokens=2, ignore_eos=True)
        async with grpc.aio.insecure_channel(address) as ch:
            return [m async for m in gateway_pb2_grpc.GatewayStub(ch).Generate(
                request, metadata=metadata, timeout=300)]
    return asyncio.run(run())


def test_up_with_api_key_requires_it_and_never_prints_it():
    key = f"k-{uuid.uuid4().hex}"
    port, http_port = free_port(), free_port()
    up = UpProcess(["--port", str(port), "--http-port", str(http_port), "--api-key", key, *WORKER_ARGS])
    try:
        up.wait_ready()
        address = f"127.0.0.1:{port}"
        with pytest.raises(grpc.RpcError) as info:
            generate(address, None)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert generate(address, key)[-1].usage.completion_tokens == 2
        models = f"http://127.0.0.1:{http_port}/v1/models"
        assert httpx.get(models, timeout=60).status_code == 401
        assert httpx.get(models, headers={"Authorization": f"Bearer {key}"}, timeout=60).status_code == 200
        chat = subprocess.run(
            [*TANDEM, "chat", "What is the capital of France?", "--address", address,
             "--max-tokens", "4", "--temperature", "0"],
            capture_output=True, text=True, timeout=300,
            env={**env_without_redis_url(), "TANDEM_API_KEY": key})
        assert chat.returncode == 0, chat.stderr[-3000:]
        assert "finish_reason=length" in chat.stdout
        refused = subprocess.run(
            [*TANDEM, "chat", "Hi", "--address", address, "--max-tokens", "2"],
            capture_output=True, text=True, timeout=300, env=env_without_redis_url())
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        assert "API keys required" in up.log
    finally:
        assert up.stop() == 0, up.log[-4000:]  # the end of the log: what did not stop
    assert key not in up.log


def test_up_with_tls_serves_https_and_grpc_tls(tmp_path):
    ca = make_ca(tmp_path)
    cert, key, _ = make_leaf(ca, tmp_path, "gateway")
    port, http_port = free_port(), free_port()
    up = UpProcess(["--port", str(port), "--http-port", str(http_port), "--tls-cert-file", str(cert),
                    "--tls-key-file", str(key), *WORKER_ARGS])
    try:
        up.wait_ready()  # the launcher sees the TLS gateway listening
        up.wait_for_log(f"https://127.0.0.1:{http_port}", 120)
        trust = ssl.create_default_context(cafile=str(ca.cert_file))
        r = httpx.get(f"https://127.0.0.1:{http_port}/v1/models", verify=trust, timeout=60)
        assert r.status_code == 200

        async def run():
            creds = grpc.ssl_channel_credentials(ca.cert_file.read_bytes())
            request = gateway_pb2.GenerateRequest(prompt="Paris is", max_tokens=2, ignore_eos=True)
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as ch:
                return [m async for m in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=300)]
        assert asyncio.run(run())[-1].usage.completion_tokens == 2
    finally:
        assert up.stop() == 0, up.log[-4000:]  # the end of the log: what did not stop
