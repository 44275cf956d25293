"""Every Tandem setting, declared once: one typed tree (``Settings``) with one section per part.

Each leaf has one default (written here, or in ``EngineConfig`` for the engine's own knobs), one
environment variable (``TANDEM_<NAME>`` unless it says otherwise) and, where a person sets it on
the command line, one flag. ``services/config/sources.py`` reads flags, environment variables
and a YAML/TOML/JSON config file (``--config``, what a Kubernetes ConfigMap mounts) into this
tree, remembering where each value came from. Library code never reads ``os.environ`` itself and
holds no literal host or port; it receives these values as constructor arguments.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.auth import read_internal_secret
from services.engine.engine_config import EngineConfig
from services.config.choices import (  # noqa: F401 - re-exported: callers name them from here
    Device, DType, KVFailurePolicy, KVTransportKind, Layout, LogFormat, LogLevel, Quantization,
    QueuePolicy, Routing)


def setting(default: Any = ..., *, help: str, env: str | None = None, flag: str | None = "",
            **constraints: Any) -> Any:
    """A leaf of the tree: ``env`` overrides the variable's name (default ``TANDEM_<NAME>``),
    ``flag`` the flag's (default ``--<name>``; ``None``: no flag, environment and file only)."""
    return Field(default, description=help, json_schema_extra={"env": env, "flag": flag},
                 **constraints)


_SECTION = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)

# Help for the engine's own knobs; their defaults live in EngineConfig (helper "engine"'s file).
ENGINE_HELP = {
    "model": "GGUF file or Hugging Face directory (default: built-in SmolLM2-135M-Instruct)",
    "dtype": "model dtype, and the KV cache's unless kv_cache_dtype says otherwise (float32: "
             "exact oracle mode; auto: bfloat16 where the CPU computes it natively, else float32)",
    "quantization": "linear layers on a GGUF weight format as stored in the file (none: dense "
                    "in dtype through torch, the oracle; auto: the file's format, F32 included, "
                    "when the CPU kernel builds)",
    "device": "torch device of a worker's model and KV cache",
    "block_size": "tokens per KV block",
    "num_kv_blocks": "KV blocks per worker; overrides kv_cache_memory_gib",
    "kv_cache_memory_gib": "KV cache memory per worker, GiB (default: 1 on CPU; on a GPU what "
                           "gpu_memory_utilization leaves after the model and its largest step)",
    "kv_cache_dtype": "KV cache element type (vLLM's --kv-cache-dtype): float16 (half the KV "
                      "bytes, each K/V value rounded once, llama.cpp's default cache type) runs "
                      "where a GGUF format's linears run in the CPU kernels; auto: float16 "
                      "there for Q4_0/Q4_1/Q8_0 linears, else the model's dtype",
    "gpu_memory_utilization": "fraction of the GPU's memory this worker may use, KV cache "
                              "included (vLLM's; `tandem up` divides it among workers sharing "
                              "a GPU)",
    "max_num_seqs": "sequences in one running batch",
    "max_num_batched_tokens": "token budget of one engine step (chunked prefill)",
    "max_model_len": "longest sequence in tokens (default: the model's context length)",
    "scheduling_policy": "continuous (iteration-level) or static batching",
    "enable_prefix_caching": "reuse the KV blocks of a shared prompt prefix",
    "long_prefill_token_threshold": "most prompt tokens one request computes per step while "
                                    "others wait (0: no cap; default: prefill workers a quarter "
                                    "of max_num_batched_tokens, others no cap)",
    "step_threads": "threads of each step: auto (timed while serving per step size, one or "
                    "all of worker.num_threads, whichever is faster) or all",
    "queue_policy": "admission order of waiting requests: fcfs (arrival) or srpt (least work "
                    "left first, aged: passed only by requests arriving before it would have "
                    "finished alone, at the measured time per token)",
    "max_step_ms": "a step with running streams computes only the prompt tokens that fit this "
                   "many ms by the measured step cost, so inter-token gaps stay near it while "
                   "prompts are prefilled (0: no budget)",
    "enforce_eager": "on a GPU, launch every step's kernels from Python instead of replaying "
                     "steps from CUDA graphs (decode and prefill steps whole, mixed steps in "
                     "pieces between attention calls; vLLM's --enforce-eager)",
    "async_scheduling": "launch each decode step before the previous one's tokens reach the "
                        "host, so the host's work overlaps the device's (vLLM's "
                        "--async-scheduling; unset: on where the KV cache is on a GPU)",
}
ENGINE_NAMES = {"kv_cache_memory_gib": ("TANDEM_KV_CACHE_GIB", "--kv-cache-gib")}


class EngineSection(EngineConfig):
    """``EngineConfig`` with closed choices as enums. Every default is ``EngineConfig``'s except
    precision, ``step_threads``, the queue policy and the step budget: a served worker
    defaults to ``auto`` (the fastest exact-enough combination this machine supports, logged at
    start; small steps on the thread count timed fastest), ``srpt`` admission and 150 ms steps
    while streams run (``max_step_ms``: docs/architecture.md says what is measured); the
    in-process engine to float32/none (the oracle mode), every thread, ``fcfs`` and no step
    budget (what its throughput benchmarks and tests measure)."""

    dtype: DType = DType.auto
    device: Device = Device(EngineConfig.model_fields["device"].default)
    quantization: Quantization = Quantization.auto
    step_threads: Literal["auto", "all"] = "auto"
    queue_policy: QueuePolicy = QueuePolicy.srpt
    max_step_ms: float | None = Field(default=150.0, ge=0)

    def engine_config(self) -> EngineConfig:
        """The plain ``EngineConfig`` the engine takes."""
        return EngineConfig(**self.model_dump(mode="json"))


class WorkerSection(BaseModel):
    """Prefill and decode workers."""
    model_config = _SECTION
    port: int = setting(0, help="worker gRPC port (0: any free port)", env="TANDEM_WORKER_PORT",
                        flag="--worker-port", ge=0, le=65535)
    kv_port: int = setting(0, help="KV transfer listen port (0: any free port)", ge=0, le=65535)
    worker_id: str = setting("", help="registry id of this worker (default: a random one)")
    advertise_host: str | None = setting(
        None, help="address peers use to reach this worker (default: host)")
    num_threads: int = setting(1, help="torch threads per worker process (`tandem up` without "
                               "it: the usable cores shared among its workers)", gt=0)
    metrics_port: int = setting(0, help="Prometheus /metrics port of a worker (0: any free "
                                "port; the port is logged at start)", ge=0, le=65535)
    kv_lease_s: float = setting(
        30.0, help="decode: seconds a KV reservation waits for its KV, and ready tokens for "
             "their reader, before the request's blocks are freed", gt=0)
    max_waiting: int = setting(256, help="requests held outside the running batch before new "
                               "ones get RESOURCE_EXHAUSTED", gt=0)
    prefill_drain_s: float = setting(
        25.0, help="prefill: seconds a worker told to stop (SIGTERM) keeps computing the prompts "
        "it holds before handing the rest back for retry on another prefill worker; below the "
        "pod's termination grace period minus kv_lease_s", ge=0)
    decode_drain_s: float = setting(
        50.0, help="decode and unified: seconds a worker told to stop (SIGTERM) lets running streams finish "
        "before migrating the rest to another decode worker; below the pod's termination grace "
        "period minus kv_lease_s", ge=0)
    publish_kv_events: bool = setting(
        True, help="publish what the prefix cache stores and evicts (KV events) to the Redis "
        "stream kv_events:WORKER_ID, from which gateways route by cached prefix")
    fault_injection: bool = setting(
        False, env="TANDEM_TEST_FAULT_INJECTION", flag=None,
        help="TEST ONLY: prefill workers honour fault tags in request ids "
             "(services/prefill/faults.py); never set it in a deployment")


class GatewaySection(BaseModel):
    """The public gateway."""
    model_config = _SECTION
    port: int = setting(50051, help="gateway gRPC port", env="TANDEM_PORT", flag="--port",
                        ge=0, le=65535)
    routing: Routing = setting(
        Routing.kv, help="how workers are picked: random (in random order), load (least loaded: "
        "prompt tokens queued for prefill and running sequences), kv (lowest cost: kv_overlap_score_weight x prompt "
        "blocks the worker would compute + its load; Dynamo's KV router)")
    kv_overlap_score_weight: float = setting(
        1.0, help="routing kv: weight of the prompt blocks a worker would compute against its "
        "load (0: pure load balancing; higher favours prefix-cache hits, TTFT)", ge=0)
    router_temperature: float = setting(
        0.0, help="routing kv/load: 0 picks the lowest cost (ties at random); higher samples "
        "workers by softmax of their normalised costs", ge=0)
    kv_events: bool = setting(
        True, help="routing kv: build the prefix index from the workers' KV events (Redis "
        "streams); off, or for a worker without events: predict caches from this gateway's "
        "own routing (approximate mode)")
    pd_threshold_tokens: int = setting(
        256, help="disaggregated: a prompt whose part not cached on the chosen decode worker is "
        "at most this many tokens, or whose wait in the prefill queue plus the KV handoff "
        "(as measured) would take longer than computing it on the decode worker, is prefilled "
        "there (no prefill worker, no KV transfer); 0: every prompt goes through a prefill "
        "worker", ge=0)
    kv_failure_policy: KVFailurePolicy = setting(
        KVFailurePolicy.recompute, help="when a prompt's KV transfer fails or times out, the "
        "decode worker computes the prompt itself (recompute) or the request fails (fail)")
    max_inflight: int = setting(
        1024, help="requests in flight before new ones get RESOURCE_EXHAUSTED", gt=0)
    http_port: int = setting(
        8000, help="OpenAI-compatible HTTP port (0: no HTTP listener)", ge=0, le=65535)
    metrics_port: int = setting(
        0, help="Prometheus /metrics port while http_port is 0 (0: any free port, logged at "
        "start); with HTTP on, /metrics is on the HTTP port", env="TANDEM_GATEWAY_METRICS_PORT",
        flag="--gateway-metrics-port", ge=0, le=65535)
    reuse_port: bool = setting(
        False, help="share the gRPC and HTTP ports with the other gateway processes of this "
        "host (SO_REUSEPORT: the kernel spreads new connections over them); /metrics and "
        "/ready then move to metrics_port, one per process", env="TANDEM_GATEWAY_REUSE_PORT",
        flag="--gateway-reuse-port")
    max_request_bytes: int = setting(
        4 * 1024 * 1024, help="largest request body in bytes (gRPC and HTTP), refused before "
        "it is parsed", gt=0)
    max_messages: int = setting(256, help="most chat messages in one request", gt=0)
    max_tokens_cap: int | None = setting(
        None, help="most output tokens one request may ask for (max_tokens; unset: the "
        "model's context)", gt=0)
    max_n: int = setting(16, help="most choices one HTTP request may ask for (n, times the prompts of a completions batch)", gt=0)
    tokenize_threads: int = setting(
        2, help="threads that render chat templates and tokenize, off the event loop", gt=0)
    drain_s: float = setting(
        80.0, env="TANDEM_GATEWAY_DRAIN_S", flag="--gateway-drain-s",
        help="seconds a gateway told to stop (SIGTERM) fails readiness, refuses new requests "
        "and lets open streams finish before it cancels the rest; below the pod's termination "
        "grace period", ge=0)
    # -- exposure (services/gateway/keys.py, limits.py, tls.py) --
    api_key: SecretStr | None = setting(
        None, help="API key clients must send (HTTP `Authorization: Bearer KEY`, gRPC "
        "`authorization` metadata); with api_keys_file too, either is accepted; neither: open")
    api_keys_file: str | None = setting(
        None, help="file of accepted API keys as SHA-256 hex digests, one per line with an "
        "optional name after it (a mounted Kubernetes Secret); re-read when it changes")
    rate_limit_requests_per_s: float = setting(
        0.0, help="requests per second per API key (token bucket, burst of one second; 0: off)",
        ge=0)
    rate_limit_tokens_per_min: int = setting(
        0, help="prompt + max_tokens per minute per API key, reconciled with the tokens used "
        "when the request ends (0: off)", ge=0)
    max_streams_per_key: int = setting(
        0, help="requests (streams) open at once per API key (0: no cap)", ge=0)
    tls_cert_file: str | None = setting(
        None, help="PEM certificate chain of the gateway's HTTP and gRPC listeners (with "
        "tls_key_file: TLS on; re-read when the files change)")
    tls_key_file: str | None = setting(None, help="PEM private key of tls_cert_file")
    tls_client_ca_file: str | None = setting(
        None, help="PEM CA bundle: clients of the gateway must present a certificate it signed "
        "(mutual TLS)")


class StateSection(BaseModel):
    """Redis: request state and the worker registry."""
    model_config = _SECTION
    redis_url: str | None = setting(
        None, env="REDIS_URL", help="Redis for request state and the worker registry, with its "
        "password if any (redis://:PASSWORD@HOST:PORT/DB); `tandem up` without it starts its own")
    heartbeat_s: float = setting(1.0, help="worker registry heartbeat, seconds", gt=0)


class TransportSection(BaseModel):
    """Internal RPCs and KV transfer between workers."""
    model_config = _SECTION
    kv_transport: KVTransportKind = setting(KVTransportKind.tcp, help="KV transfer backend")
    kv_transfer_timeout_s: float = setting(
        30.0, help="prefill: deadline of one KV write, seconds (never past the lease)", gt=0)
    rpc_timeout_s: float = setting(600.0, help="deadline of internal RPCs, seconds", gt=0)
    internal_secret: SecretStr | None = setting(
        None, flag=None, help="shared secret of internal gRPC and KV ports (`tandem up` "
        "generates one per run)")
    internal_secret_file: str | None = setting(
        None, flag=None, help="file holding the internal secret (a mounted Kubernetes Secret)")
    internal_tls_cert_file: str | None = setting(
        None, help="PEM certificate of this process for internal gRPC (workers serve it, the "
        "gateway presents it); with key and CA: mutual TLS between gateway and workers")
    internal_tls_key_file: str | None = setting(None, help="PEM private key of internal_tls_cert_file")
    internal_tls_ca_file: str | None = setting(
        None, help="PEM CA bundle that signed every internal certificate (both sides verify)")
    internal_tls_server_name: str | None = setting(
        None, help="name internal clients expect in a worker's certificate (default: the "
        "host of its endpoint)")


class ObservabilitySection(BaseModel):
    """Logs and traces (services/observability/); OTEL_* variables configure the exporter."""
    model_config = _SECTION
    log_format: LogFormat = setting(
        LogFormat.text, help="log lines as text, or json (one object per line, with request_id, "
        "trace_id, span_id)")
    otlp_traces_endpoint: str | None = setting(
        None, help="OTLP endpoint to export traces to (e.g. http://collector:4317; "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL grpc or http/protobuf); unset: tracing off unless "
        "OTEL_EXPORTER_OTLP_ENDPOINT is set")


class SupervisorSection(BaseModel):
    """How `tandem up` restarts a child that exits (as Kubernetes restarts a container)."""
    model_config = _SECTION
    restart_limit: int = setting(
        5, help="restarts of one child within restart_window_s before the stack stops", ge=0)
    restart_window_s: float = setting(60.0, help="crash-loop window, seconds", gt=0)
    restart_backoff_s: float = setting(
        0.5, help="delay before the first restart, seconds; doubles with each recent restart", ge=0)
    restart_backoff_max_s: float = setting(10.0, help="longest delay before a restart, seconds",
                                           ge=0)


class UpSection(BaseModel):
    """`tandem up`'s local layout (services/runtime/layout.py); unset counts: the layout's."""
    model_config = _SECTION
    layout: Layout = setting(
        Layout.auto, help="workers to start: auto (unified on machines with at most "
        "auto_unified_max_cores usable cores, else disaggregated), disaggregated or unified; "
        "worker counts imply it")
    num_prefill: int | None = setting(None, help="prefill workers (disaggregated; default 1)", gt=0)
    num_decode: int | None = setting(None, help="decode workers (disaggregated; default 1)", gt=0)
    num_unified: int | None = setting(None, help="unified workers (default 1)", gt=0)
    auto_unified_max_cores: int = setting(
        4, help="layout auto: most usable CPU cores on which unified workers are chosen", ge=0)
    num_gateways: int | None = setting(
        None, help="gateway processes sharing the gateway's gRPC and HTTP ports "
        "(gateway.reuse_port; vLLM's --api-server-count): each streams to its own clients, so "
        "more relay more tokens/s where one gateway's CPU is the bound (a GPU's decode rate); "
        "default 1 on CPUs, on GPUs one per 4 usable cores up to 4", gt=0)


class Settings(BaseSettings):
    """The whole configuration; build it with ``services.config.sources.load_settings``."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    host: str = setting("127.0.0.1", help="address services listen on")
    log_level: LogLevel = setting(LogLevel.INFO, help="logging level")
    engine: EngineSection = Field(default_factory=EngineSection)
    worker: WorkerSection = Field(default_factory=WorkerSection)
    gateway: GatewaySection = Field(default_factory=GatewaySection)
    state: StateSection = Field(default_factory=StateSection)
    transport: TransportSection = Field(default_factory=TransportSection)
    supervisor: SupervisorSection = Field(default_factory=SupervisorSection)
    up: UpSection = Field(default_factory=UpSection)
    observability: ObservabilitySection = Field(default_factory=ObservabilitySection)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, *args, **kwargs):
        # NOTE: load_settings() merges flags, environment and file itself (it must know where
        # each value came from); the tree validates only what it is given.
        return (init_settings,)

    def internal_secret(self) -> str | None:
        """The internal secret (``services.auth.read_internal_secret``: ``internal_secret`` or
        the contents of ``internal_secret_file``, at least 16 characters). Raises ValueError
        naming the variable."""
        t = self.transport
        given = t.internal_secret.get_secret_value() if t.internal_secret is not None else None
        return read_internal_secret(given, t.internal_secret_file)


SECTIONS = ("engine", "worker", "gateway", "state", "transport", "supervisor", "up",
            "observability")
