"""``tandem``: run the stack (``up``), one service (``serve``), a client (``chat``), the
engine in-process (``generate``) or a benchmark (``bench offline|online``). Flags default to
the environment variables of settings.py."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import grpc

from services import settings as S


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=S.MODEL.get(), help=S.MODEL.help + " (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=S.DEVICE.get(), help=S.DEVICE.help)
    p.add_argument("--dtype", default=S.DTYPE.get(), help=S.DTYPE.help)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=float, default=S.KV_CACHE_GIB.get(), help=S.KV_CACHE_GIB.help)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="overrides --kv-cache-gib")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-threads", type=int, default=S.NUM_THREADS.get(), help=S.NUM_THREADS.help)


def _engine_config(args):
    from services.engine.engine import EngineConfig

    fields = dict(device=args.device, dtype=args.dtype,
                  block_size=args.block_size, kv_cache_memory_gib=args.kv_cache_gib,
                  num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    if args.model:
        fields["model"] = args.model
    return EngineConfig(**fields)


def _gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-failure-policy", choices=["recompute", "fail"],
                   default=S.KV_FAILURE_POLICY.get(), help=S.KV_FAILURE_POLICY.help)
    p.add_argument("--max-inflight", type=int, default=S.MAX_INFLIGHT.get(), help=S.MAX_INFLIGHT.help)


def _worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-lease-s", type=float, default=S.KV_LEASE_S.get(), help=S.KV_LEASE_S.help)
    p.add_argument("--kv-transfer-timeout-s", type=float, default=S.KV_TRANSFER_TIMEOUT_S.get(),
                   help=S.KV_TRANSFER_TIMEOUT_S.help)
    p.add_argument("--max-waiting", type=int, default=S.MAX_WAITING.get(), help=S.MAX_WAITING.help)


def _service_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=S.HOST.get(), help=S.HOST.help)
    p.add_argument("--advertise-host", default=S.ADVERTISE_HOST.get(), help=S.ADVERTISE_HOST.help)
    p.add_argument("--redis-url", default=S.REDIS_URL.get(), help=S.REDIS_URL.help)
    p.add_argument("--heartbeat-s", type=float, default=S.HEARTBEAT_S.get(), help=S.HEARTBEAT_S.help)
    p.add_argument("--rpc-timeout-s", type=float, default=S.RPC_TIMEOUT_S.get(), help=S.RPC_TIMEOUT_S.help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--log-level", default=S.LOG_LEVEL.get())
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start gateway + prefill + decode workers locally")
    _service_flags(up)
    _engine_flags(up)
    up.add_argument("--port", type=int, default=S.GATEWAY_PORT.get(), help=S.GATEWAY_PORT.help)
    up.add_argument("--num-prefill", type=int, default=1)
    up.add_argument("--num-decode", type=int, default=1)
    up.add_argument("--kv-transport", default=S.KV_TRANSPORT.get(), help=S.KV_TRANSPORT.help)
    _gateway_flags(up)
    _worker_flags(up)
    up.add_argument("--chat", metavar="MESSAGE", help="send one chat message once ready, print "
                    "the streamed answer, then stop the stack")
    _sampling_flags(up)  # for --chat

    serve = sub.add_parser("serve", help="run one service in this process")
    serve.add_argument("role", choices=["gateway", "prefill", "decode"])
    _service_flags(serve)
    _engine_flags(serve)
    serve.add_argument("--port", type=int, default=None, help="gRPC port (gateway: TANDEM_PORT, "
                       "workers: TANDEM_WORKER_PORT)")
    serve.add_argument("--worker-id", default="")
    serve.add_argument("--kv-port", type=int, default=S.KV_PORT.get(), help=S.KV_PORT.help)
    serve.add_argument("--kv-transport", default=S.KV_TRANSPORT.get(), help=S.KV_TRANSPORT.help)
    _gateway_flags(serve)
    _worker_flags(serve)

    chat = sub.add_parser("chat", help="chat with a running gateway (message, or lines on stdin)")
    chat.add_argument("message", nargs="?")
    chat.add_argument("--address", default=f"{S.HOST.get()}:{S.GATEWAY_PORT.get()}")
    _sampling_flags(chat)

    gen = sub.add_parser("generate", help="generate in-process, no services (unified role)")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    _engine_flags(gen)
    _sampling_flags(gen)

    bench = sub.add_parser("bench", help="benchmarks: offline (engine in-process) or online (a gateway)")
    bench.add_argument("mode", choices=["offline", "online"])
    bench.add_argument("bench_args", nargs=argparse.REMAINDER,
                       help="flags of the benchmark (see `tandem bench offline -- --help`)")
    return parser


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)


def _sampling_options(args) -> dict:
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return {"up": cmd_up, "serve": cmd_serve, "chat": cmd_chat, "generate": cmd_generate,
                "bench": cmd_bench}[args.command](args)
    except grpc.RpcError as exc:
        print(f"tandem {args.command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError, ConnectionError, FileNotFoundError, TimeoutError) as exc:
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 1


def cmd_serve(args) -> int:
    import uvloop

    from services.serve import serve_gateway, serve_worker
    from services.worker import WorkerOptions

    if not args.redis_url:
        raise ValueError("--redis-url (or REDIS_URL) is required for `tandem serve`")
    for flag in ("max_inflight", "max_waiting", "kv_lease_s", "kv_transfer_timeout_s", "rpc_timeout_s"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')}: must be > 0, got {getattr(args, flag)}")
    model = args.model or str(_engine_config(args).model)
    if args.role == "gateway":
        port = S.GATEWAY_PORT.get() if args.port is None else args.port
        uvloop.run(serve_gateway(args.host, port, args.redis_url, model, args.rpc_timeout_s,
                                 args.heartbeat_s, args.kv_failure_policy, args.max_inflight))
        return 0
    opts = WorkerOptions(
        role=args.role, engine=_engine_config(args), host=args.host,
        advertise_host=args.advertise_host or args.host,
        port=S.WORKER_PORT.get() if args.port is None else args.port, kv_port=args.kv_port,
        kv_transport=args.kv_transport, redis_url=args.redis_url, heartbeat_s=args.heartbeat_s,
        kv_lease_s=args.kv_lease_s, worker_id=args.worker_id, max_waiting=args.max_waiting,
        rpc_timeout_s=args.rpc_timeout_s, kv_transfer_timeout_s=args.kv_transfer_timeout_s,
        fault_injection=S.TEST_FAULT_INJECTION.get())
    uvloop.run(serve_worker(opts, args.num_threads))
    return 0


def cmd_up(args) -> int:
    from services.client import print_chat
    from services.launcher import Stack, UpOptions, run_until_interrupted

    worker_args = ["--device", args.device, "--dtype", args.dtype,
                   "--block-size", str(args.block_size), "--kv-cache-gib", str(args.kv_cache_gib),
                   "--max-num-seqs", str(args.max_num_seqs), "--num-threads", str(args.num_threads),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--kv-transport", args.kv_transport, "--heartbeat-s", str(args.heartbeat_s),
                   "--kv-lease-s", str(args.kv_lease_s), "--max-waiting", str(args.max_waiting),
                   "--kv-transfer-timeout-s", str(args.kv_transfer_timeout_s),
                   "--rpc-timeout-s", str(args.rpc_timeout_s)]
    if args.num_kv_blocks:
        worker_args += ["--num-kv-blocks", str(args.num_kv_blocks)]
    model_args = ["--model", args.model] if args.model else []
    gateway_args = ["--heartbeat-s", str(args.heartbeat_s), "--rpc-timeout-s", str(args.rpc_timeout_s),
                    "--kv-failure-policy", args.kv_failure_policy, "--max-inflight", str(args.max_inflight)]
    stack = Stack(UpOptions(args.host, args.port, args.num_prefill, args.num_decode, args.redis_url,
                            worker_args + model_args, model_args + gateway_args))
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


def cmd_chat(args) -> int:
    from services.client import chat_repl, print_chat

    if args.message:
        print_chat(args.address, [{"role": "user", "content": args.message}], **_sampling_options(args))
    else:
        chat_repl(args.address, **_sampling_options(args))
    return 0


def cmd_generate(args) -> int:
    import torch

    from services.engine.llm import LLM
    from services.engine.sampling_params import SamplingParams

    torch.set_num_threads(args.num_threads)
    llm = LLM(_engine_config(args))
    params = SamplingParams(**_sampling_options(args))
    if args.raw:
        result = llm.generate([args.prompt], params)[0]
    else:
        result = llm.chat([[{"role": "user", "content": args.prompt}]], params)[0]
    print(result.text)
    return 0


def cmd_bench(args) -> int:
    bench_args = [a for a in args.bench_args if a != "--"]
    if args.mode == "offline":
        from loadtest.offline import main as offline_main

        return offline_main(bench_args)
    from loadtest.online import main as online_main

    online_main(bench_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
