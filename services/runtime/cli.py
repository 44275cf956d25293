"""``tandem``: run the stack (``up``), one service (``serve``), a client (``chat``), the engine
in-process (``generate``), a benchmark (``bench MODE``) or print the effective configuration
(``config show``). Every setting is one leaf of ``services/config/settings.py``'s tree, read from its
flag, its ``TANDEM_*`` environment variable or a config file (``--config``), in that order."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

import grpc

from services.observability.logs import configure_logging
from services.config.sources import (
    FLAG_PREFIX, LoadedSettings, SettingsError, add_setting_flags, flag_values, load_settings,
    markdown_table, show_lines)

BENCH_MODES = ("offline", "online", "serve", "plot", "sweep")
# Not flags of `tandem up`: it gives each worker its own id and a free port, and --log-level is
# the main parser's (`tandem --log-level DEBUG up`).
NOT_UP_FLAGS = {"worker.port", "worker.kv_port", "worker.worker_id", "log_level"}


def _config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML, TOML or JSON settings file, nested "
                   "by section (flags and environment variables override it) [TANDEM_CONFIG]")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)


def _sampling_options(args) -> dict:
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    add_setting_flags(parser, select=lambda path: path == "log_level")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a gateway and workers locally (prefill + decode, or "
                        "unified: layout chosen for the machine, see --layout), supervised")
    _config_flag(up)
    add_setting_flags(up, select=lambda path: path not in NOT_UP_FLAGS)
    up.add_argument("--unified", action="store_true", help="same as --layout unified")
    up.add_argument("--chat", metavar="MESSAGE", help="send one chat message once ready, print "
                    "the streamed answer, then stop the stack")
    _sampling_flags(up)  # for --chat

    serve = sub.add_parser("serve", help="run one service in this process")
    serve.add_argument("role", choices=["gateway", "prefill", "decode", "unified"])
    _config_flag(serve)
    add_setting_flags(serve, select=lambda path: path != "log_level" and not path.startswith("up."))
    port = next(a for a in serve._actions if "--port" in a.option_strings)
    port.help = "gRPC port of this service (gateway: gateway.port [TANDEM_PORT]; workers: " \
                "worker.port [TANDEM_WORKER_PORT])"

    chat = sub.add_parser("chat", help="chat with a running gateway (message, or lines on stdin)")
    chat.add_argument("message", nargs="?")
    chat.add_argument("--address", help="gateway HOST:PORT (default: host and gateway.port)")
    _config_flag(chat)
    _sampling_flags(chat)

    gen = sub.add_parser("generate", help="generate in-process, no services (unified role)")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    _config_flag(gen)
    add_setting_flags(gen, select=lambda p: p.startswith("engine.") or p == "worker.num_threads")
    _sampling_flags(gen)

    bench = sub.add_parser("bench", help="benchmarks: loadtest.MODE's main(ARGS)")
    bench.add_argument("mode", choices=BENCH_MODES)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER,
                       help="flags of the benchmark (see `tandem bench offline -- --help`)")
    _add_config(sub)
    return parser


def _add_config(sub) -> None:
    config = sub.add_parser("config", help="the effective configuration")
    show = config.add_subparsers(dest="config_command", required=True).add_parser(
        "show", help="print every setting's effective value and where it came from "
        "(flag, environment variable, config file line, or default)")
    show.add_argument("--markdown", action="store_true",
                      help="print the settings table of the README instead")
    _config_flag(show)
    add_setting_flags(show)


def _load(args) -> LoadedSettings:
    flags = flag_values(args)
    if getattr(args, "role", "gateway") != "gateway" and "gateway.port" in flags:
        flags["worker.port"] = flags.pop("gateway.port")  # `serve decode --port N`
    if getattr(args, "unified", False):
        if flags.get("up.layout", ("unified",))[0] != "unified":
            raise SettingsError(f"up.layout: --unified contradicts --layout {flags['up.layout'][0]}")
        flags["up.layout"] = ("unified", "flag --unified")
    return load_settings(flags, getattr(args, "config", None) or os.environ.get("TANDEM_CONFIG"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = f"tandem {args.command}"
    if args.command == "bench":
        configure_logging(getattr(args, FLAG_PREFIX + "log_level", "INFO").upper())
        return _run(name, cmd_bench, args)
    try:
        loaded = _load(args)
    except SettingsError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(loaded.settings.log_level.value, loaded.settings.observability.log_format.value)
    commands = {"up": cmd_up, "serve": cmd_serve, "chat": cmd_chat, "generate": cmd_generate,
                "config": cmd_config}
    return _run(name, commands[args.command], args, loaded)


def _run(name: str, command, *args) -> int:
    try:
        return command(*args)
    except grpc.RpcError as exc:
        print(f"{name}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    # OSError: a port taken, a file missing, a connection refused or timed out
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1


def cmd_serve(args, loaded: LoadedSettings) -> int:
    import uvloop

    from services.observability import tracing
    from services.runtime.serve import serve_gateway, serve_worker

    s = loaded.settings
    if not s.state.redis_url:
        raise ValueError("state.redis_url: required for `tandem serve` (--redis-url or REDIS_URL)")
    tracing.configure(args.role, s.observability.otlp_traces_endpoint,
                      "" if args.role == "gateway" else s.worker.worker_id)
    try:
        if args.role == "gateway":
            uvloop.run(serve_gateway(gateway_options(s)))
        else:
            uvloop.run(serve_worker(worker_options(s, args.role), s.worker.num_threads))
    finally:
        tracing.shutdown()  # export the spans still buffered
    return 0


def gateway_options(s):
    """The settings tree -> the gateway's ``GatewayOptions``."""
    from services.gateway.app import GatewayOptions
    from services.gateway.router import RoutingOptions
    from services.gateway.validation import RequestLimits

    g = s.gateway
    return GatewayOptions(
        s.host, g.port, s.state.redis_url, s.engine.model, s.transport.rpc_timeout_s,
        s.state.heartbeat_s, g.kv_failure_policy.value, g.max_inflight,
        RequestLimits(g.max_request_bytes, g.max_messages, g.max_tokens_cap, g.max_n),
        g.tokenize_threads, g.http_port or None,
        internal_secret=s.internal_secret(), drain_s=g.drain_s, metrics_port=g.metrics_port,
        reuse_port=g.reuse_port,
        routing=RoutingOptions(g.routing.value, g.kv_overlap_score_weight, g.router_temperature,
                               g.kv_events, g.pd_threshold_tokens),
        **exposure_options(s))


def exposure_options(s) -> dict:
    """API keys, per-key limits, TLS and internal mutual TLS of the gateway (services.gateway.
    access/tls). Raises ValueError naming a setting (a keys file that does not parse...)."""
    from services.gateway.access import exposure_options as build

    return build(s)


def worker_options(s, role: str):
    """The settings tree -> one worker's ``WorkerOptions``."""
    from services.auth import InternalTls
    from services.runtime.worker import WorkerOptions

    w, t = s.worker, s.transport
    return WorkerOptions(
        role=role, engine=s.engine.engine_config(), host=s.host,
        advertise_host=w.advertise_host or s.host, port=w.port, kv_port=w.kv_port,
        kv_transport=t.kv_transport.value, redis_url=s.state.redis_url,
        heartbeat_s=s.state.heartbeat_s, kv_lease_s=w.kv_lease_s, worker_id=w.worker_id,
        max_waiting=w.max_waiting, rpc_timeout_s=t.rpc_timeout_s,
        kv_transfer_timeout_s=t.kv_transfer_timeout_s, fault_injection=w.fault_injection,
        internal_secret=s.internal_secret(),
        drain_s=w.prefill_drain_s if role == "prefill" else w.decode_drain_s,  # unified: decode's
        internal_tls=InternalTls.from_settings(t.internal_tls_cert_file, t.internal_tls_key_file,
                                               t.internal_tls_ca_file, t.internal_tls_server_name),
        metrics_port=w.metrics_port, publish_kv_events=w.publish_kv_events)


def cmd_up(args, loaded: LoadedSettings) -> int:
    from services.runtime.client import print_chat
    from services.runtime.launcher import Stack, UpOptions, run_until_interrupted

    s = loaded.settings
    layout = up_layout(loaded)
    stack = Stack(UpOptions(s.host, s.gateway.port, layout.num_prefill, layout.num_decode,
                            s.state.redis_url, settings=s, num_unified=layout.num_unified,
                            threads=layout.threads, num_gateways=layout.num_gateways))
    try:
        stack.start()
        stack.wait_ready()
        http_port = stack.settings.gateway.http_port
        logging.getLogger("tandem").info(
            "Tandem is up: %s at %s (gRPC)%s (%s)",
            "gateways" if layout.num_gateways > 1 else "gateway", stack.address,
            f" and http://{stack.opts.host}:{http_port}/v1 (OpenAI HTTP)" if http_port else "",
            layout.describe())
        if args.chat:
            print(f">>> {args.chat}")
            print_chat(stack.address, [{"role": "user", "content": args.chat}],
                       api_key=_api_key(s), **_sampling_options(args))
        else:
            run_until_interrupted(stack)
    finally:
        stack.stop()
    return 0


def _api_key(s) -> str | None:
    """The key ``tandem chat`` / ``up --chat`` send (gateway.api_key: TANDEM_API_KEY)."""
    return s.gateway.api_key.get_secret_value() if s.gateway.api_key else None


def up_layout(loaded: LoadedSettings):
    """The workers `tandem up` starts (``services.runtime.layout``), logged with why."""
    from services.runtime.layout import choose_layout, usable_cores, visible_gpus
    from services.config.settings import Device

    s = loaded.settings
    explicit = loaded.source("worker.num_threads") != "default"
    gpus = visible_gpus() if s.engine.device == Device.cuda else None
    layout = choose_layout(s.up, usable_cores(), s.worker.num_threads if explicit else None, gpus,
                           shared_port=bool(s.gateway.port))
    logging.getLogger("tandem").info("layout: %s (%s; override with --layout, --unified or "
                                     "worker counts)", layout.describe(), layout.reason)
    return layout


def cmd_chat(args, loaded: LoadedSettings) -> int:
    from services.runtime.client import chat_repl, print_chat

    s = loaded.settings
    address = args.address or f"{s.host}:{s.gateway.port}"
    if args.message:
        print_chat(address, [{"role": "user", "content": args.message}], api_key=_api_key(s),
                   **_sampling_options(args))
    else:
        chat_repl(address, api_key=_api_key(s), **_sampling_options(args))
    return 0


def cmd_generate(args, loaded: LoadedSettings) -> int:
    import torch

    from services.engine.llm import LLM
    from services.engine.sampling_params import SamplingParams

    s = loaded.settings
    torch.set_num_threads(s.worker.num_threads)
    llm = LLM(s.engine.engine_config())
    params = SamplingParams(**_sampling_options(args))
    if args.raw:
        result = llm.generate([args.prompt], params)[0]
    else:
        result = llm.chat([[{"role": "user", "content": args.prompt}]], params)[0]
    print(result.text)
    return 0


def cmd_bench(args) -> int:
    """``loadtest.<mode>.main(argv)``; a mode whose module is not in this checkout is a clear
    error, not a traceback."""
    bench_args = [a for a in args.bench_args if a != "--"]
    module_name = f"loadtest.{args.mode}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise RuntimeError(f"{module_name} is not in this checkout: `tandem bench {args.mode}` "
                           "is unavailable") from None
    return int(module.main(bench_args) or 0)


def cmd_config(args, loaded: LoadedSettings) -> int:
    print(markdown_table() if args.markdown else "\n".join(show_lines(loaded)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
