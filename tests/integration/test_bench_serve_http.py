"""``python -m loadtest.serve`` against a real stack over the gateway's OpenAI-compatible HTTP
(``--target http://HOST:PORT/v1``, issue 16), at a small rate for a few seconds. The stack is the
unified layout (what `tandem up` picks on a small machine): the result JSON has every field,
token counts equal the server's records, the plots are PNGs, the unified worker's load was
sampled, and a goodput SLO no request can meet gives 0 goodput."""
from __future__ import annotations

import json

import httpx
import pytest

from services.runtime.launcher import Stack, UpOptions
from tests.integration.conftest import WORKER_ARGS, free_port, running
from tests.integration.test_bench_serve import (
    assert_counts_equal_the_servers, assert_every_field_and_all_completed,
    assert_plots_are_png, assert_zero_goodput, run_bench_serve)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def http_stack(redis_server):
    """One unified worker and a gateway serving gRPC and HTTP."""
    http_port = free_port()
    s = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=0, num_decode=0,
                        num_unified=1, redis_url=redis_server.url, worker_args=WORKER_ARGS,
                        gateway_args=["--heartbeat-s", "0.5", "--http-port", str(http_port)],
                        ready_timeout_s=240))
    with running(s):
        yield s, f"http://127.0.0.1:{http_port}/v1"


@pytest.fixture(scope="module")
def http_run(http_stack, redis_server, tmp_path_factory):
    stack, url = http_stack
    out = tmp_path_factory.mktemp("serve-http")
    return run_bench_serve(["--target", url, "--endpoint", "chat"], "5", redis_server.url,
                           stack.internal_secret, out)


def test_http_result_json_has_every_field_and_all_requests_completed(http_run):
    _, result, stdout = http_run
    assert_every_field_and_all_completed(result)
    assert result["backend"] == "openai-chat" and result["target"].startswith("http://")
    assert set(result["by_kind"]) == {"chat", "long"}
    assert "Serving Benchmark Result" in stdout and "Mean TTFT (ms)" in stdout


def test_http_token_counts_equal_the_servers_records(http_run, http_stack):
    _, result, _ = http_run
    stack, _ = http_stack
    infos = assert_counts_equal_the_servers(result, stack.address)
    assert all(i.prefill_worker == i.decode_worker == "unified-0" for i in infos)


def test_http_slo_no_request_can_meet_gives_zero_goodput(http_run):
    _, result, _ = http_run
    assert_zero_goodput(result)


def test_http_plots_are_png_files(http_run):
    assert_plots_are_png(http_run[0])


def test_unified_workers_load_was_sampled(http_run):
    _, result, _ = http_run
    view = result["server_view"]
    assert view["num_samples"] > 0
    assert {w["role"] for w in view["workers"].values()} == {"unified"}
    worker = view["workers"]["unified-0"]
    assert worker["max_running_batch"] >= 1  # it computed prompts and decoded them
    assert 0.0 <= worker["mean_kv_usage"] <= worker["max_kv_usage"] <= 1.0


def test_unified_prefix_cache_hits_are_cached_tokens(http_stack):
    """The unified worker computes the prompt itself, so its hits reach ``usage`` through the
    decode stream (``DecodeResponse.num_cached_tokens``), not a prefill worker's response."""
    _, url = http_stack
    prompt = "Count these for me: " + ", ".join(f"box {i}" for i in range(40))
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 4,
            "temperature": 0}
    usages = []
    for stream in (False, True):  # the second request is the one that can hit
        r = httpx.post(f"{url}/completions", timeout=60, json={
            **body, "stream": stream, "stream_options": {"include_usage": True}}
            if stream else body)
        assert r.status_code == 200, r.text
        if stream:
            last = [line for line in r.text.splitlines() if '"usage"' in line][-1]
            usages.append(json.loads(last.removeprefix("data: "))["usage"])
        else:
            usages.append(r.json()["usage"])
    n = usages[1]["prompt_tokens"]
    assert n > 3 * 16
    # every full block but the one holding the last prompt token (recomputed for its logits)
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
