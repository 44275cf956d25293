"""Prometheus metrics: the engine's own statistics (exact values after real steps, each role's
view), the collector that maps them to ``tandem:`` samples, the gateway's client-side view,
vLLM's bucket boundaries, and the scrape config ``tandem up`` writes."""
from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import generate_latest

from services.engine import metrics as em
from services.engine.metrics import EngineMetrics, Histogram, buckets_1_2_5
from services.engine.sampling_params import SamplingParams
from services.observability.metrics import TokenClock
from services.observability.metrics import GatewayMetrics, WorkerMetrics
from services.observability.scrape import scrape_config, write_scrape_config
from services.errors import ResourceExhausted, Unavailable, error_status
from tests.unit.test_engine import make_engine

LABELS = {"model_name": "m", "role": "decode", "worker_id": "w0"}


def sample(registry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, {**LABELS, **labels})


# ---------------------------------------------------------------------- vLLM's buckets
def test_bucket_boundaries_are_vllms():
    # vllm/v1/metrics/loggers.py (PrometheusStatLogger)
    assert em.TTFT_BUCKETS_S == (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
    assert em.ITL_BUCKETS_S == (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
    assert em.REQUEST_LATENCY_BUCKETS_S == (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                                            20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                                            960.0, 1920.0, 7680.0)
    assert em.ITERATION_TOKEN_BUCKETS == (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                          8192, 16384)
    assert buckets_1_2_5(8192) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)


def test_histogram_buckets_are_upper_bounds_inclusive():
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 2.0, 3.0):
        h.observe(v)
    assert h.counts == [2, 2, 1] and h.count == 5 and h.sum == 8.0


def test_every_family_is_exposed_with_vllms_buckets():
    engine = fake_engine(EngineMetrics(max_model_len=8192))
    registry = WorkerMetrics("m", "decode", "w0", engine, lambda: _Reservations(0, {})).registry
    text = generate_latest(registry).decode()
    les = [line.split('le="')[1].split('"')[0] for line in text.splitlines()
           if line.startswith("tandem:time_to_first_token_seconds_bucket")]
    assert les == [repr(b) for b in em.TTFT_BUCKETS_S] + ["+Inf"]
    for name in ("tandem:inter_token_latency_seconds", "tandem:e2e_request_latency_seconds",
                 "tandem:request_queue_time_seconds", "tandem:request_prefill_time_seconds",
                 "tandem:request_decode_time_seconds", "tandem:request_prompt_tokens",
                 "tandem:request_generation_tokens", "tandem:iteration_tokens_total",
                 "tandem:kv_transfer_seconds", "tandem:kv_transfer_bytes"):
        assert sample(registry, name + "_count") == 0, name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "kv_reservations_active",
                 "kv_lease_expired_total"):
        assert sample(registry, "tandem:" + name) is not None, name
    assert "_created" not in text


# ---------------------------------------------------------------------- the collector
def fake_engine(metrics: EngineMetrics, running: int = 0, waiting: int = 0, free: int = 10,
                total: int = 10):
    return SimpleNamespace(metrics=metrics,
                           scheduler=SimpleNamespace(running=[object()] * running, num_waiting=waiting),
                           block_manager=SimpleNamespace(num_free_blocks=free, num_blocks=total))


class _Reservations(dict):
    def __init__(self, active: int, closes: dict[str, int]) -> None:
        super().__init__((str(i), None) for i in range(active))
        self.closes = closes


def test_collector_maps_engine_metrics_to_exact_samples():
    m = EngineMetrics(max_model_len=64)
    m.prefix_cache_queries, m.prefix_cache_hits, m.num_preemptions = 96, 48, 3
    m.num_generated_tokens = 17
    m.requests.num_prompt_tokens = 123
    m.requests.finished.update(stop=4, length=2, abort=1)
    m.requests.time_to_first_token.observe(0.03)
    m.requests.time_to_first_token.observe(0.5)
    m.requests.request_prompt_tokens.observe(40)
    reservations = _Reservations(2, {"expired": 5, "landed": 9})
    registry = WorkerMetrics("m", "decode", "w0", fake_engine(m, running=3, waiting=4, free=25, total=100),
                             lambda: reservations).registry
    assert sample(registry, "tandem:num_requests_running") == 3
    assert sample(registry, "tandem:num_requests_waiting") == 4
    assert sample(registry, "tandem:kv_cache_usage_perc") == 0.75
    assert sample(registry, "tandem:prefix_cache_queries_total") == 96
    assert sample(registry, "tandem:prefix_cache_hits_total") == 48
    assert sample(registry, "tandem:num_preemptions_total") == 3
    assert sample(registry, "tandem:prompt_tokens_total") == 123
    assert sample(registry, "tandem:generation_tokens_total") == 17
    for reason, n in (("stop", 4), ("length", 2), ("abort", 1)):
        assert sample(registry, "tandem:request_success_total", finished_reason=reason) == n
    assert sample(registry, "tandem:time_to_first_token_seconds_count") == 2
    assert sample(registry, "tandem:time_to_first_token_seconds_sum") == pytest.approx(0.53)
    assert sample(registry, "tandem:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert sample(registry, "tandem:time_to_first_token_seconds_bucket", le="0.5") == 2
    assert sample(registry, "tandem:time_to_first_token_seconds_bucket", le="+Inf") == 2
    # token buckets follow the model's context: 1-2-5 up to 64
    assert sample(registry, "tandem:request_prompt_tokens_bucket", le="20.0") == 0
    assert sample(registry, "tandem:request_prompt_tokens_bucket", le="50.0") == 1
    assert sample(registry, "tandem:request_prompt_tokens_bucket", le="100.0") is None
    assert sample(registry, "tandem:kv_reservations_active") == 2
    assert sample(registry, "tandem:kv_lease_expired_total") == 5


def test_the_collector_reads_the_engines_current_metrics_object():
    engine = fake_engine(EngineMetrics())
    registry = WorkerMetrics("m", "decode", "w0", engine).registry
    fresh = EngineMetrics()
    fresh.num_generated_tokens = 7
    engine.metrics = fresh  # what warm_up and benchmarks do
    assert sample(registry, "tandem:generation_tokens_total") == 7
    assert sample(registry, "tandem:kv_reservations_active") is None  # no reservations: not decode


# ---------------------------------------------------------------------- real engine steps
GREEDY3 = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def run(engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def registry_of(engine, role: str = "decode"):
    return WorkerMetrics("m", role, "w0", engine).registry


def test_unified_engine_counts_every_token_and_request_once():
    engine = make_engine()
    prompts = [list(range(10, 30)), list(range(40, 47))]
    for i, p in enumerate(prompts):
        engine.add_request(engine.make_request(f"r{i}", p, GREEDY3))
    outputs = run(engine)
    r = registry_of(engine)
    assert sample(r, "tandem:generation_tokens_total") == sum(map(len, outputs.values())) == 6
    assert sample(r, "tandem:prompt_tokens_total") == 27
    assert sample(r, "tandem:request_success_total", finished_reason="length") == 2
    assert sample(r, "tandem:time_to_first_token_seconds_count") == 2
    assert sample(r, "tandem:inter_token_latency_seconds_count") == 4  # 2 gaps per request
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time",
                 "request_decode_time"):
        assert sample(r, f"tandem:{name}_seconds_count") == 2, name
    assert sample(r, "tandem:request_prompt_tokens_sum") == 27
    assert sample(r, "tandem:request_generation_tokens_sum") == 6
    assert sample(r, "tandem:iteration_tokens_total_sum") == engine.metrics.num_batched_tokens == 27 + 4
    assert sample(r, "tandem:iteration_tokens_total_count") == engine.metrics.num_steps
    assert sample(r, "tandem:kv_cache_usage_perc") == 0
    assert sample(r, "tandem:num_requests_running") == sample(r, "tandem:num_requests_waiting") == 0


def test_prefill_role_counts_its_first_tokens_but_no_finished_request():
    engine = make_engine()
    prompt = list(range(10, 30))
    engine.add_request(engine.make_request("p0", prompt, SamplingParams(temperature=0, max_tokens=1),
                                           hold_kv=True))
    assert len(run(engine)["p0"]) == 1
    r = registry_of(engine, "prefill")
    get = lambda name, **kw: sample(r, name, role="prefill", **kw)  # noqa: E731
    assert get("tandem:generation_tokens_total") == 1
    assert get("tandem:prompt_tokens_total") == 20
    assert get("tandem:time_to_first_token_seconds_count") == 1
    assert get("tandem:request_prefill_time_seconds_count") == 1
    assert get("tandem:request_success_total", finished_reason="length") == 0  # decode counts it
    assert get("tandem:e2e_request_latency_seconds_count") == 0
    assert get("tandem:kv_cache_usage_perc") > 0  # held until the KV is sent
    engine.release("p0")
    assert get("tandem:kv_cache_usage_perc") == 0


def test_decode_role_counts_the_landed_first_token_as_ttft_not_as_generated():
    engine = make_engine()
    prompt = list(range(10, 30))
    request = engine.make_request("d0", prompt, GREEDY3)
    assert engine.reserve(request)
    r = registry_of(engine)
    assert sample(r, "tandem:num_requests_waiting") == 1  # waiting for its KV
    first = engine.finish_remote_prefill("d0", 7)
    assert first.new_token_ids == [7]
    outputs = run(engine)
    assert len(outputs["d0"]) == 2
    assert sample(r, "tandem:generation_tokens_total") == 2  # the first came from the prefill worker
    assert sample(r, "tandem:prompt_tokens_total") == 0  # computed elsewhere
    assert sample(r, "tandem:time_to_first_token_seconds_count") == 1
    assert sample(r, "tandem:request_queue_time_seconds_count") == 1  # landing -> admitted
    assert sample(r, "tandem:request_prefill_time_seconds_count") == 0
    assert sample(r, "tandem:inter_token_latency_seconds_count") == 2
    assert sample(r, "tandem:request_success_total", finished_reason="length") == 1
    assert sample(r, "tandem:request_generation_tokens_sum") == 3
    assert not engine.metrics.requests.landed


def test_aborts_count_once_with_reason_abort():
    engine = make_engine()
    waiting_for_kv = engine.make_request("a0", list(range(10, 30)), GREEDY3)
    assert engine.reserve(waiting_for_kv)
    engine.finish_remote_prefill("a0", 7)  # landed, not yet admitted
    engine.add_request(engine.make_request("a1", list(range(10, 30)), GREEDY3))
    assert engine.abort("a0") and engine.abort("a1")
    assert not engine.abort("a1")  # unknown by now: not counted again
    r = registry_of(engine)
    assert sample(r, "tandem:request_success_total", finished_reason="abort") == 2
    assert sample(r, "tandem:e2e_request_latency_seconds_count") == 2
    assert sample(r, "tandem:kv_cache_usage_perc") == 0
    assert not engine.metrics.requests.landed  # nothing kept for a request that is gone


# ---------------------------------------------------------------------- the gateway
def test_gateway_token_clock_observes_ttft_once_and_itl_per_later_token():
    g = GatewayMetrics("m", in_flight=lambda: 5, gateway_id="gw")
    clock = TokenClock(g, arrival_time=0.0)
    clock.sent(2)  # first message: 2 tokens
    clock.sent(0)  # a message with no token (finish only)
    clock.sent(3)
    clock.ended("OK")
    labels = {"model_name": "m", "role": "gateway", "worker_id": "gw"}
    get = lambda name, **kw: g.registry.get_sample_value(name, {**labels, **kw})  # noqa: E731
    assert get("tandem:time_to_first_token_seconds_count") == 1
    assert get("tandem:inter_token_latency_seconds_count") == 4  # 5 tokens, 4 after the first
    assert get("tandem:e2e_request_latency_seconds_count") == 1
    assert get("tandem:requests_total", code="OK") == 1
    assert get("tandem:num_requests_in_flight") == 5
    TokenClock(g, 0.0).ended("CANCELLED")  # no e2e for a request that did not finish
    assert get("tandem:e2e_request_latency_seconds_count") == 1
    assert get("tandem:requests_total", code="CANCELLED") == 1
    g.worker_lost(had_tokens=True)
    g.worker_lost(had_tokens=False)
    g.worker_lost(had_tokens=False)
    assert get("tandem:requests_migrated_total") == 1 and get("tandem:prefill_retries_total") == 2


def test_gateway_status_codes_of_pipeline_errors():
    def _code(exc: BaseException) -> str:
        return error_status(exc).grpc_code

    assert _code(ValueError("prompt: empty")) == "INVALID_ARGUMENT"
    assert _code(ResourceExhausted("full")) == "RESOURCE_EXHAUSTED"
    assert _code(Unavailable("redis")) == "UNAVAILABLE"
    assert _code(asyncio.CancelledError()) == "CANCELLED"
    assert _code(RuntimeError("bug")) == "INTERNAL"


# ---------------------------------------------------------------------- scrape config
def test_scrape_config_lists_every_target(tmp_path):
    targets = {"gateway": "127.0.0.1:9100", "decode-0": "127.0.0.1:9101"}
    path = write_scrape_config(tmp_path / "prometheus.yml", targets, interval_s=1)
    doc = yaml.safe_load(path.read_text())
    assert doc == scrape_config(targets, 1)
    assert doc["global"]["scrape_interval"] == "1000ms"
    (job,) = doc["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert {t["targets"][0]: t["labels"]["process"] for t in job["static_configs"]} == {
        "127.0.0.1:9100": "gateway", "127.0.0.1:9101": "decode-0"}
    with pytest.raises(ValueError, match="^interval_s"):
        scrape_config(targets, 0)


def test_a_steps_tokens_recorded_at_once_equal_one_by_one():
    """``RequestStats.on_tokens`` (a decode step's requests in one call) records what
    ``on_token`` per request does: first tokens, gaps, and finishes alike."""
    from services.engine.request import Request, RequestStatus

    def requests() -> list[Request]:
        first = Request("first", [1, 2], SamplingParams(max_tokens=4), arrival_time=1.0)
        first.first_scheduled_time = 1.5
        rs = [first]
        for i, last in enumerate((2.0, 2.25, 2.5)):
            r = Request(f"r{i}", [1, 2], SamplingParams(max_tokens=4), arrival_time=1.0)
            r.first_scheduled_time, r.first_token_time, r.last_token_time = 1.5, 1.75, last
            r.output_token_ids = [5, 6]
            rs.append(r)
        rs[-1].status = RequestStatus.FINISHED_LENGTH
        return rs

    one, many = em.RequestStats(), em.RequestStats()
    by_one, by_many = requests(), requests()
    for r in by_one:
        one.on_token(r, 3.0)
    many.on_tokens(by_many, 3.0)
    assert many.histograms() == one.histograms() and many.finished == one.finished
    assert one.finished["length"] == 1 and one.inter_token_latency.count == 3
    assert [r.last_token_time for r in by_many] == [r.last_token_time for r in by_one]
    # the usual step: every request past its first token, none finished, their last tokens
    # at a few times (counted per distinct time)
    steady_one, steady_many = requests()[1:3] * 3, requests()[1:3] * 3
    for rs in (steady_one, steady_many):
        rs[:] = [dataclasses.replace(r, request_id=f"{r.request_id}-{i}", status=RequestStatus.RUNNING)
                 for i, r in enumerate(rs)]
    for r in steady_one:
        one.on_token(r, 3.0)
    many.on_tokens(steady_many, 3.0)
    assert many.histograms() == one.histograms() and one.inter_token_latency.count == 9
    assert [r.last_token_time for r in steady_many] == [3.0] * 6
    for r in steady_one:  # every last token at one time
        one.on_token(r, 3.5)
    many.on_tokens(steady_many, 3.5)
    assert many.histograms() == one.histograms() and one.inter_token_latency.count == 15


def test_metrics_server_answers_ready_from_its_callback():
    """A gateway on a shared port serves /ready of its own process on its /metrics port: 200
    or 503 with the reason, as the callback says at each request; /metrics beside it."""
    import json
    import urllib.error
    import urllib.request

    from prometheus_client import CollectorRegistry

    from services.observability.metrics import MetricsServer

    state = {"ready": (False, "no live decode worker")}
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, ready=lambda: state["ready"])
    url = f"http://127.0.0.1:{server.port}"
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/ready", timeout=10)
        assert refused.value.code == 503
        assert json.loads(refused.value.read()) == {"ready": False,
                                                     "reason": "no live decode worker"}
        state["ready"] = (True, "")
        with urllib.request.urlopen(f"{url}/ready", timeout=10) as resp:
            assert resp.status == 200 and json.loads(resp.read()) == {"ready": True, "reason": ""}
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            assert resp.status == 200
    finally:
        server.close()
    plain = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)  # a worker's: no /ready route
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{plain.port}/ready", timeout=10) as resp:
            assert resp.status == 200 and b"ready" not in resp.read()  # the metrics page
    finally:
        plain.close()


def test_a_shared_gateway_port_must_be_fixed():
    from services.gateway.app import GatewayOptions

    with pytest.raises(ValueError, match="gateway.reuse_port"):
        GatewayOptions("127.0.0.1", 0, "redis://x", "m", 1.0, 1.0, reuse_port=True)
    assert GatewayOptions("127.0.0.1", 7000, "redis://x", "m", 1.0, 1.0, reuse_port=True).reuse_port
