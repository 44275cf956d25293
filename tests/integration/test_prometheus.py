"""A real Prometheus (Debian's ``prometheus`` package) scrapes a real stack (gateway, prefill and
decode processes) with the scrape config ``tandem up`` writes; after N streamed requests, PromQL
through its HTTP API returns what the client saw. And every metric the Grafana dashboard
queries exists in a live scrape of the three services."""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from services.api import gateway_pb2, gateway_pb2_grpc
from services.observability.scrape import scrape_config, write_scrape_config
from tests.integration.conftest import free_port

PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.integration, pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus binary is not installed (Debian package "
    "`prometheus`; scripts/setup.sh --test installs it)")]
DASHBOARD = Path(__file__).parents[2] / "k8s/components/observability/grafana-dashboard.json"
PROMPTS = ["Name three colours.", "What is 2 + 2?", "Say hello in French."]
MAX_TOKENS = 6


def http_get(url: str, timeout_s: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read()


class Prometheus:
    """``prometheus`` on a free loopback port, scraping ``targets`` every second, its TSDB in
    ``data_dir``; ``query(promql)`` -> {labels: value} of an instant vector or scalar."""

    def __init__(self, targets: dict[str, str], data_dir: Path) -> None:
        config = write_scrape_config(data_dir / "prometheus.yml", targets, interval_s=1.0)
        self.address = f"127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={data_dir / 'tsdb'}",
             f"--web.listen-address={self.address}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"prometheus exited: {self.proc.stderr.read().decode()[-2000:]}"
            try:
                if http_get(f"http://{self.address}/-/ready", 2.0):
                    return
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, f"prometheus not ready within {timeout_s}s"
            time.sleep(0.2)

    def query(self, promql: str) -> float | None:
        """The value of a PromQL expression that yields one series or a scalar (None: empty)."""
        url = f"http://{self.address}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        body = json.loads(http_get(url))
        assert body["status"] == "success", body
        data = body["data"]
        if data["resultType"] == "scalar":
            return float(data["result"][1])
        assert len(data["result"]) <= 1, f"{promql}: more than one series: {data['result']}"
        return float(data["result"][0]["value"][1]) if data["result"] else None

    def targets_up(self) -> int:
        return int(self.query('sum(up{job="tandem"})') or 0)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    prom = Prometheus(stack.metrics_targets, tmp_path_factory.mktemp("prometheus"))
    try:
        prom.wait_ready(60)
        yield prom
    finally:
        prom.stop()


async def stream(address: str, prompt: str) -> tuple[int, int]:
    """(tokens streamed, prompt tokens) of one chat request."""
    request = gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role="user", content=prompt)], max_tokens=MAX_TOKENS,
        temperature=0, ignore_eos=True)
    tokens, usage = 0, None
    async with grpc.aio.insecure_channel(address) as channel:
        async for msg in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=300):
            tokens += len(msg.token_ids)
            if msg.finish_reason:
                usage = msg.usage
    return tokens, usage.prompt_tokens


def wait_for(prom: Prometheus, promql: str, expected: float, timeout_s: float = 60.0) -> None:
    """Wait until ``promql`` evaluates to ``expected`` (scrapes are 1 s apart)."""
    deadline, value = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        value = prom.query(promql)
        if value == expected:
            return
        time.sleep(0.5)
    raise AssertionError(f"{promql} = {value}, expected {expected} (within {timeout_s}s)")


def test_promql_counts_equal_what_the_client_saw(stack, prometheus):
    assert set(stack.metrics_targets) == {"gateway", "prefill-0", "decode-0"}
    written = yaml.safe_load((stack.run_dir / "prometheus.yml").read_text())  # what `up` logs
    assert written == scrape_config(stack.metrics_targets)
    wait_for(prometheus, 'sum(up{job="tandem"})', 3)

    async def run_all():
        return await asyncio.gather(*(stream(stack.address, p) for p in PROMPTS))

    results = asyncio.run(run_all())
    n, streamed = len(PROMPTS), sum(t for t, _ in results)
    assert streamed == n * MAX_TOKENS
    prompt_tokens = sum(p for _, p in results)
    wait_for(prometheus, 'sum(tandem:generation_tokens_total{role!="gateway"})', streamed)
    wait_for(prometheus, 'sum(tandem:time_to_first_token_seconds_count{role="gateway"})', n)
    wait_for(prometheus, 'sum(tandem:request_success_total{role="decode"})', n)
    wait_for(prometheus, 'sum(tandem:request_success_total{finished_reason="length"})', n)
    wait_for(prometheus, "sum(tandem:prompt_tokens_total)", prompt_tokens)
    wait_for(prometheus, 'sum(tandem:requests_total{code="OK"})', n)
    wait_for(prometheus, "sum(tandem:requests_total)", n)
    # each request: TTFT at every hop; inter-token gaps = tokens - 1 at the client and decode
    wait_for(prometheus, 'sum(tandem:time_to_first_token_seconds_count{role="prefill"})', n)
    wait_for(prometheus, 'sum(tandem:time_to_first_token_seconds_count{role="decode"})', n)
    wait_for(prometheus, 'sum(tandem:inter_token_latency_seconds_count{role="gateway"})', streamed - n)
    wait_for(prometheus, 'sum(tandem:inter_token_latency_seconds_count{role="decode"})', streamed - n)
    wait_for(prometheus, "sum(tandem:request_generation_tokens_sum)", streamed)
    wait_for(prometheus, "sum(tandem:kv_transfer_seconds_count)", n)
    # the gateway's view of each handoff, which conditional disaggregation weighs
    wait_for(prometheus, 'sum(tandem:kv_handoff_seconds_count{role="gateway"})', n)
    assert prometheus.query('sum(tandem:kv_handoff_seconds_sum{role="gateway"})') > 0
    wait_for(prometheus, "sum(tandem:kv_transfer_failures_total)", 0)
    assert prometheus.query("sum(tandem:kv_transfer_bytes_sum)") > 0
    # nothing held once the streams have ended
    wait_for(prometheus, "max(tandem:kv_cache_usage_perc)", 0)
    wait_for(prometheus, "sum(tandem:kv_reservations_active)", 0)
    wait_for(prometheus, "sum(tandem:num_requests_in_flight)", 0)
    wait_for(prometheus, "sum(tandem:num_requests_running) + sum(tandem:num_requests_waiting)", 0)


def scraped_names(address: str) -> set[str]:
    text = http_get(f"http://{address}/metrics").decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_every_metric_the_dashboard_queries_exists_in_a_live_scrape(stack):
    names = {target: scraped_names(address) for target, address in stack.metrics_targets.items()}
    assert "tandem:requests_total" in names["gateway"]
    assert all("tandem:kv_cache_usage_perc" in names[w] for w in ("prefill-0", "decode-0"))
    live = set().union(*names.values())
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs and all("tandem:" in e for e in exprs)
    # every PromQL string in the file: panel targets and the template variables' queries
    queried = set(re.findall(r"tandem:[a-z0-9_:]+", DASHBOARD.read_text()))
    assert len(queried) >= 20, sorted(queried)
    assert not queried - live, f"queried by the dashboard, absent from every scrape: {sorted(queried - live)}"


def test_metrics_server_keeps_tandem_names_whatever_format_is_asked():
    """prometheus-client would escape ':' to '_' in OpenMetrics, which Prometheus asks for."""
    from services.observability.metrics import GatewayMetrics, MetricsServer

    server = MetricsServer(GatewayMetrics("m", gateway_id="gw").registry, "127.0.0.1", 0)
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/metrics",
            headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = resp.read().decode()
    finally:
        server.close()
    assert 'tandem:requests_total{code="OK",model_name="m",role="gateway",worker_id="gw"} 0.0' in text
    assert "tandem_" not in text


def gateway_samples(url: str) -> dict[tuple[str, str], float]:
    """(sample name, its ``code`` label or "") -> value, from the gateway's HTTP /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http_get(f"{url}/metrics").decode()
    return {(s.name, s.labels.get("code", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_gateway_serves_metrics_on_its_http_port_counting_http_requests(stack):
    import httpx

    from tests.integration.test_gateway_http import HttpGateway, chat_body

    gateway = HttpGateway(stack.redis_url, stack.internal_secret)
    try:
        gateway.wait_ready()
        ok = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(), timeout=300)
        assert ok.status_code == 200
        bad = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat_body(temperature=-1), timeout=60)
        assert bad.status_code == 400
        samples = gateway_samples(gateway.url)
    finally:
        gateway.close()
    assert samples[("tandem:requests_total", "OK")] == 1
    assert samples[("tandem:requests_total", "INVALID_ARGUMENT")] == 1
    assert samples[("tandem:time_to_first_token_seconds_count", "")] == 1
    assert samples[("tandem:e2e_request_latency_seconds_count", "")] == 1
    assert samples[("tandem:inter_token_latency_seconds_count", "")] == ok.json()["usage"]["completion_tokens"] - 1
    assert samples[("tandem:num_requests_in_flight", "")] == 0
