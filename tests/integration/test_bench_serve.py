"""``python -m loadtest.serve`` against a real stack over gRPC, at a small rate for a few seconds:
the result JSON has every field, token counts equal the server's records, the plots are PNGs, the
workers' load was sampled, and a goodput SLO no request can meet gives 0 goodput."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.api import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.integration

NUM_PROMPTS = 6
LONG_OUTPUT = 4
VLLM_FIELDS = ("completed", "failed", "duration", "request_throughput", "request_goodput",
               "output_throughput", "total_token_throughput", "total_input_tokens",
               "total_output_tokens", "num_prompts", "request_rate", "burstiness", "max_concurrency",
               "input_lens", "output_lens", "ttfts", "itls", "errors")
REPO = Path(__file__).resolve().parents[2]


async def server_records(address: str, request_ids: list[str]) -> list[gateway_pb2.RequestInfo]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        return [await stub.GetRequest(gateway_pb2.GetRequestRequest(request_id=r), timeout=10)
                for r in request_ids]


@pytest.fixture(scope="module")
def serve_run(stack, redis_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve")
    return run_bench_serve(["--target", f"grpc://{stack.address}"], "3", redis_server.url,
                           stack.internal_secret, out)


def test_result_json_has_every_field_and_all_requests_completed(serve_run):
    _, result, stdout = serve_run
    assert_every_field_and_all_completed(result)
    assert result["request_rate"] == 3 and result["backend"] == "tandem-grpc"
    assert set(result["by_kind"]) == {"chat", "long"}
    assert "Serving Benchmark Result" in stdout and "Mean TTFT (ms)" in stdout


def test_token_counts_equal_the_servers_records(serve_run, stack):
    _, result, _ = serve_run
    assert_counts_equal_the_servers(result, stack.address)


def test_an_slo_no_request_can_meet_gives_zero_goodput(serve_run):
    _, result, _ = serve_run
    assert_zero_goodput(result)


def test_plots_are_png_files(serve_run):
    assert_plots_are_png(serve_run[0])


def test_workers_load_was_sampled_over_the_run(serve_run):
    _, result, _ = serve_run
    view = result["server_view"]
    assert view["num_samples"] > 0
    roles = {w["role"] for w in view["workers"].values()}
    assert roles == {"prefill", "decode"}
    decode = next(w for w in view["workers"].values() if w["role"] == "decode")
    assert 0.0 <= decode["mean_kv_usage"] <= decode["max_kv_usage"] <= 1.0
    assert set(decode) == {"role", "mean_running_batch", "max_running_batch", "mean_waiting",
                           "mean_kv_usage", "max_kv_usage", "preemptions", "migrations"}


def assert_counts_equal_the_servers(result: dict, address: str, long_output: int = LONG_OUTPUT) -> list:
    """Every request FINISHED with the token counts the gateway's records hold (a long-mix
    long request exactly ``long_output``); returns the records."""
    records = result["requests"]
    infos = asyncio.run(server_records(address, [r["request_id"] for r in records]))
    for record, info in zip(records, infos):
        assert info.status == "FINISHED", info
        assert record["prompt_len"] == info.prompt_tokens > 0
        assert record["output_tokens"] == info.output_tokens > 0
        if record["kind"] == "long":
            assert record["output_tokens"] == long_output  # ignore_eos: exact
    assert result["total_input_tokens"] == sum(i.prompt_tokens for i in infos)
    assert result["total_output_tokens"] == sum(i.output_tokens for i in infos)
    return infos


def assert_zero_goodput(result: dict) -> None:
    assert result["request_goodput"] == 0.0 and result["slo_attainment"] == 0.0
    assert result["request_throughput"] > 0


def assert_plots_are_png(out) -> None:
    for kind in ("latency_cdf", "timeline", "throughput"):
        data = (out / f"run-{kind}.png").read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 2000, kind


def run_bench_serve(target: list[str], seed: str, redis_url: str, secret: str, out: Path):
    """``loadtest.serve`` on the long-mix dataset against ``target`` (its flags): (result dir,
    result JSON, stdout). Every SLO is unmeetable (1 us), so goodput must be 0."""
    argv = [sys.executable, "-m", "loadtest.serve", *target,
            "--request-rate", "3", "--num-prompts", str(NUM_PROMPTS), "--dataset", "long-mix",
            "--long-fraction", "0.5", "--long-input-range", "64:96",
            "--long-output-len", str(LONG_OUTPUT), "--chat-max-tokens", "6", "--seed", seed,
            "--goodput", "ttft:0.001", "tpot:0.001", "--percentiles", "50,90,99",
            "--redis-url", redis_url, "--server-poll-s", "0.2", "--save-detailed",
            "--disable-progress", "--time-limit", "60", "--request-timeout", "120",
            "--result-dir", str(out), "--result-name", "run"]
    env = {**os.environ, "TANDEM_INTERNAL_SECRET": secret}  # the workers' GetLoad
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "run.json").read_text()), proc.stdout


def assert_every_field_and_all_completed(result: dict) -> None:
    for field in VLLM_FIELDS:
        assert field in result, field
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert result[f"{stat}_{metric}_ms"] >= 0, (stat, metric)
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, result["failed_requests"]
    assert result["not_sent"] == 0 and result["duration"] > 0
