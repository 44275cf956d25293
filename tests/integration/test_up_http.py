"""`tandem up` exposes OpenAI HTTP: the port given (`--http-port`, default 8000; the
integration package sets TANDEM_HTTP_PORT=0, off, so parallel stacks never collide) is in the
"Tandem is up" line, and /ready, /v1/models and a completion answer there."""
from __future__ import annotations

import httpx
import pytest

from tests.integration.conftest import WORKER_ARGS, free_port
from tests.integration.up_process import UpProcess

pytestmark = pytest.mark.integration


def test_tandem_up_serves_openai_http_on_the_port_given():
    http_port = free_port()
    up = UpProcess(["--port", str(free_port()), "--http-port", str(http_port), *WORKER_ARGS])
    try:
        up.wait_ready(300)
        base = f"http://127.0.0.1:{http_port}"
        assert f"and {base}/v1 (OpenAI HTTP)" in up.log
        assert httpx.get(f"{base}/ready", timeout=30).status_code == 200
        assert httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
        r = httpx.post(f"{base}/v1/completions", timeout=300, json={
            "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert up.stop() == 0, up.log[-4000:]  # the end of the log: what did not stop
    finally:
        up.proc.kill()

