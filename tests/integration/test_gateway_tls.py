"""TLS at the gateway and mutual TLS between gateway and workers, with throwaway certificates
(``tls_certs.py``): a client trusting the test CA is served over HTTPS and gRPC TLS, a
plaintext client is refused, a replaced certificate is served to new connections without a
restart; a stack whose workers require client certificates serves a request through its
gateway, and a worker client without a certificate is refused."""
from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Iterator

import grpc
import httpx
import pytest

from services.api import gateway_pb2, gateway_pb2_grpc, worker_pb2
from services.auth import InternalTls, internal_channel
from services.engine.model_files import default_model_path
from services.gateway.app import GatewayOptions
from services.gateway.tls import POLL_S, TlsFiles
from services.runtime.launcher import Stack, UpOptions
from services.config.sources import load_settings
from tests.integration.conftest import (
    WORKER_ARGS, GatewayThread, free_port, registered_workers, wait_until, worker_stub)
from tests.integration.tls_certs import make_ca, make_leaf

pytestmark = pytest.mark.integration

DEADLINE_S = 120.0


class TlsGateway:
    def __init__(self, stack, tls: TlsFiles, ca_file) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.url = f"https://127.0.0.1:{self.http_port}"
        self.trust = ssl.create_default_context(cafile=str(ca_file))
        self._thread = GatewayThread(GatewayOptions(
            "127.0.0.1", self.port, stack.redis_url, str(default_model_path()), rpc_timeout_s=120.0,
            heartbeat_s=0.5, http_port=self.http_port, internal_secret=stack.internal_secret, tls=tls))
        self._thread.wait_http_ready(self.url, verify=self.trust)

    def close(self) -> None:
        self._thread.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca = make_ca(d)
    cert, key, der = make_leaf(ca, d, "gateway")
    return d, ca, cert, key, der


@pytest.fixture(scope="module")
def tls_gateway(stack, certs) -> Iterator[TlsGateway]:
    d, ca, cert, key, _ = certs
    g = TlsGateway(stack, TlsFiles(str(cert), str(key)), ca.cert_file)
    try:
        yield g
    finally:
        g.close()


def served_cert(port: int, alpn: str) -> bytes:
    """DER of the certificate a new TLS connection to 127.0.0.1:``port`` is shown."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols([alpn])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            return tls.getpeercert(binary_form=True)


def grpc_generate(address: str, credentials: grpc.ChannelCredentials | None):
    async def run():
        request = gateway_pb2.GenerateRequest(prompt="Paris is", max_tokens=3, temperature=0.0,
                                              ignore_eos=True)
        channel = (grpc.aio.secure_channel(address, credentials) if credentials
                   else grpc.aio.insecure_channel(address))
        async with channel:
            return [m async for m in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=300)]
    return asyncio.run(run())


def test_https_and_grpc_tls_serve_a_client_trusting_the_ca(tls_gateway, certs):
    _, ca, *_ = certs
    r = httpx.post(f"{tls_gateway.url}/v1/completions", verify=tls_gateway.trust, timeout=300,
                   json={"prompt": "Paris is", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    root = ca.cert_file.read_bytes()
    msgs = grpc_generate(f"127.0.0.1:{tls_gateway.port}", grpc.ssl_channel_credentials(root))
    assert msgs[-1].usage.completion_tokens == 3


def test_plaintext_clients_are_refused(tls_gateway):
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{tls_gateway.http_port}/health", timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        grpc_generate(f"127.0.0.1:{tls_gateway.port}", None)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
        httpx.get(f"{tls_gateway.url}/health", timeout=30)


def test_replaced_certificate_is_served_to_new_connections(tls_gateway, certs):
    d, ca, _, _, old = certs
    assert served_cert(tls_gateway.http_port, "http/1.1") == old
    assert served_cert(tls_gateway.port, "h2") == old
    _, _, new = make_leaf(ca, d, "gateway")  # same paths, new key and certificate

    async def rotated(port, alpn):
        return await asyncio.to_thread(served_cert, port, alpn) == new

    asyncio.run(wait_until(lambda: rotated(tls_gateway.http_port, "http/1.1"),
                           DEADLINE_S, "HTTPS serves the new certificate", poll_s=POLL_S / 4))
    asyncio.run(wait_until(lambda: rotated(tls_gateway.port, "h2"), DEADLINE_S,
                           "gRPC serves the new certificate", poll_s=POLL_S / 4))
    r = httpx.get(f"{tls_gateway.url}/health", verify=tls_gateway.trust, timeout=30)
    assert r.status_code == 200


@pytest.fixture(scope="module")
def mtls_stack(certs) -> Iterator[tuple[Stack, InternalTls]]:
    """A stack whose internal gRPC is mutual TLS, with a Redis of its own: its gateway must see
    no plaintext worker of another module's stack in the registry."""
    d, ca, *_ = certs
    cert, key, _ = make_leaf(ca, d, "internal")
    internal = InternalTls(str(cert), str(key), str(ca.cert_file))
    files = {"cert": cert, "key": key, "ca": ca.cert_file}
    settings = load_settings({f"transport.internal_tls_{k}_file": (str(v), "test")
                              for k, v in files.items()}).settings
    s = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=1, num_decode=1,
                        redis_url=None, worker_args=WORKER_ARGS,
                        gateway_args=["--heartbeat-s", "0.5"], ready_timeout_s=300, settings=settings))
    try:
        s.start()
        s.wait_ready()
        yield s, internal
    finally:
        s.stop()


def test_internal_mutual_tls_serves_and_refuses_clients_without_a_certificate(mtls_stack, certs):
    stack, internal = mtls_stack
    _, ca, *_ = certs
    msgs = grpc_generate(stack.address, None)  # the public listener is plaintext here
    assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == 3

    async def check():
        workers = [w for w in await registered_workers(stack.redis_url)
                   if w.worker_id in {name for name, _ in stack.procs}]
        assert {w.role for w in workers} == {"prefill", "decode"}
        for w in workers:
            async with internal_channel(w.endpoint, stack.internal_secret, internal) as ch:
                load = await worker_stub(w, ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=30)
                assert load.total_kv_blocks > 0
            no_cert = grpc.ssl_channel_credentials(ca.cert_file.read_bytes())
            for channel in (grpc.aio.secure_channel(w.endpoint, no_cert),
                            internal_channel(w.endpoint, stack.internal_secret)):  # plaintext
                async with channel:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await worker_stub(w, channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=30)
                    assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(check())
