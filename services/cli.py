"""``tandem``: run the stack (``up``), one service (``serve``), a client (``chat``), the engine
in-process (``generate``), a benchmark (``bench MODE``) or print the effective configuration
(``config show``). Every setting is one leaf of ``services/settings.py``'s tree, read from its
flag, its ``TANDEM_*`` environment variable or a config file (``--config``), in that order."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

import grpc

from services.settings_sources import (
    FLAG_PREFIX, LoadedSettings, SettingsError, add_setting_flags, flag_values, load_settings,
    markdown_table, show_lines)

BENCH_MODES = ("offline", "online", "serve", "plot", "sweep")
# Not flags of `tandem up`: it gives each worker its own id and a free port, and --log-level is
# the main parser's (`tandem --log-level DEBUG up`).
NOT_UP_FLAGS = {"worker.port", "worker.kv_port", "worker.worker_id", "log_level"}


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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

    up = sub.add_parser("up", help="start gateway + prefill + decode workers locally, supervised")
    _config_flag(up)
    add_setting_flags(up, select=lambda path: path not in NOT_UP_FLAGS)
    up.add_argument("--num-prefill", type=_positive_int, default=1)
    up.add_argument("--num-decode", type=_positive_int, default=1)
    up.add_argument("--chat", metavar="MESSAGE", help="send one chat message once ready, print "
                    "the streamed answer, then stop the stack")
    _sampling_flags(up)  # for --chat

    serve = sub.add_parser("serve", help="run one service in this process")
    serve.add_argument("role", choices=["gateway", "prefill", "decode"])
    _config_flag(serve)
    add_setting_flags(serve, select=lambda path: path != "log_level")
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
    return load_settings(flags, getattr(args, "config", None) or os.environ.get("TANDEM_CONFIG"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = f"tandem {args.command}"
    if args.command == "bench":
        logging.basicConfig(level=getattr(args, FLAG_PREFIX + "log_level", "INFO").upper())
        return _run(name, cmd_bench, args)
    try:
        loaded = _load(args)
    except SettingsError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=loaded.settings.log_level.value,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {"up": cmd_up, "serve": cmd_serve, "chat": cmd_chat, "generate": cmd_generate,
                "config": cmd_config}
    return _run(name, commands[args.command], args, loaded)


def _run(name: str, command, *args) -> int:
    try:
        return command(*args)
    except grpc.RpcError as exc:
        print(f"{name}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError, ConnectionError, FileNotFoundError, TimeoutError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1


def cmd_serve(args, loaded: LoadedSettings) -> int:
    import uvloop

    from services.serve import serve_gateway, serve_worker

    s = loaded.settings
    if not s.state.redis_url:
        raise ValueError("state.redis_url: required for `tandem serve` (--redis-url or REDIS_URL)")
    if args.role == "gateway":
        uvloop.run(serve_gateway(gateway_options(s)))
        return 0
    uvloop.run(serve_worker(worker_options(s, args.role), s.worker.num_threads))
    return 0


def gateway_options(s):
    """The settings tree -> the gateway's ``GatewayOptions``."""
    from services.gateway.app import GatewayOptions
    from services.gateway.validation import RequestLimits

    g = s.gateway
    return GatewayOptions(
        s.host, g.port, s.state.redis_url, s.engine.model, s.transport.rpc_timeout_s,
        s.state.heartbeat_s, g.kv_failure_policy.value, g.max_inflight,
        RequestLimits(g.max_request_bytes, g.max_messages), g.tokenize_threads, g.http_port,
        internal_secret=s.internal_secret(), metrics_port=g.metrics_port)


def worker_options(s, role: str):
    """The settings tree -> one worker's ``WorkerOptions``."""
    from services.worker import WorkerOptions

    w, t = s.worker, s.transport
    return WorkerOptions(
        role=role, engine=s.engine.engine_config(), host=s.host,
        advertise_host=w.advertise_host or s.host, port=w.port, kv_port=w.kv_port,
        kv_transport=t.kv_transport.value, redis_url=s.state.redis_url,
        heartbeat_s=s.state.heartbeat_s, kv_lease_s=w.kv_lease_s, worker_id=w.worker_id,
        max_waiting=w.max_waiting, rpc_timeout_s=t.rpc_timeout_s,
        kv_transfer_timeout_s=t.kv_transfer_timeout_s, fault_injection=w.fault_injection,
        internal_secret=s.internal_secret(), metrics_port=w.metrics_port)


def cmd_up(args, loaded: LoadedSettings) -> int:
    from services.client import print_chat
    from services.launcher import Stack, UpOptions, run_until_interrupted

    s = loaded.settings
    stack = Stack(UpOptions(s.host, s.gateway.port, args.num_prefill, args.num_decode,
                            s.state.redis_url, settings=s))
    try:
        stack.start()
        stack.wait_ready()
        logging.getLogger("tandem").info("Tandem is up: gateway at %s (%d prefill, %d decode)",
                                         stack.address, args.num_prefill, args.num_decode)
        if args.chat:
            print(f">>> {args.chat}")
            print_chat(stack.address, [{"role": "user", "content": args.chat}], **_sampling_options(args))
        else:
            run_until_interrupted(stack)
    finally:
        stack.stop()
    return 0


def cmd_chat(args, loaded: LoadedSettings) -> int:
    from services.client import chat_repl, print_chat

    s = loaded.settings
    address = args.address or f"{s.host}:{s.gateway.port}"
    if args.message:
        print_chat(address, [{"role": "user", "content": args.message}], **_sampling_options(args))
    else:
        chat_repl(address, **_sampling_options(args))
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
