"""What serving costs beside the model (issue 27): CPU milliseconds per output token of each part
of a running stack, and the stack's tokens/s against the in-process engine's at the same batch.

    python -m scripts.bench_serving_cpu [--concurrency 16,64] [--num-prompts 128] \\
        [--api grpc|http] [--engine-args "--quantization auto"] [--client-processes 1] \\
        [--out bench-results/serving_cpu.json]

The stack is `tandem up`'s (the layout it picks here, a private Redis), loaded by ``tandem
bench serve`` with random prompts of ``--input-len`` tokens and exactly ``--output-len`` output
tokens each (``ignore_eos``), all sent at once under the concurrency cap. Around each load the
script reads every stack process's CPU seconds from ``/proc`` (user + system, all threads); a
worker's CPU is split by thread name into the model's (the engine thread and the OpenMP threads
its kernels start, named ``tandem-engine``) and the serving's (event loop, gRPC, Redis client,
KV transfer); ``client`` is the load generator's (this process and the ``--client-processes``
it spawns). Then, with the stack stopped, the in-process engine runs the same workload at the
same batch caps (prefill included; output tokens over wall time), the ratio issues 27 and 36
ask for, and decode steps alone at that batch (``scripts.bench_quant.decode_rate``) beside it.

Both sides run the settings a worker of the stack runs (``worker_settings``): ``--engine-args``
(the workers' flags) over the environment (``TANDEM_MODEL``, ``TANDEM_DEVICE``,
``TANDEM_DTYPE``, ...) over the defaults, so the in-process engine loads the workers' model on
their device with their engine settings, its batch capped at the concurrency. The layout and
the gateway count are `tandem up`'s for those settings (``TANDEM_LAYOUT``,
``TANDEM_NUM_GATEWAYS``; on a GPU, ``TANDEM_DEVICE=cuda``, the GPUs it sees).
CPU time is steadier than wall time on a shared machine, but compare figures within one run.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shlex
import time
from pathlib import Path

from loadtest import serve
from scripts.bench_layout import free_port
from services.config.settings import Settings
from services.config.sources import LoadedSettings, add_setting_flags, flag_values, load_settings
from services.engine.engine_loop import ENGINE_THREAD_NAME
from services.runtime.cli import up_layout
from services.runtime.launcher import Stack, UpOptions
from services.runtime.layout import usable_cores


def _ticks(stat_path: str) -> int:
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def cpu_split(pid: int) -> tuple[float, float]:
    """(CPU seconds of the whole process, of its threads named ``tandem-engine``)."""
    hz = os.sysconf("SC_CLK_TCK")
    engine = 0
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/comm") as f:
                if f.read().strip() == ENGINE_THREAD_NAME:
                    engine += _ticks(f"{task}/stat")
        except OSError:  # the thread ended meanwhile
            continue
    return _ticks(f"/proc/{pid}/stat") / hz, engine / hz


def sample(stack: Stack) -> dict[str, tuple[float, float]]:
    """Every stack process's ``cpu_split``, by name (redis-server included), and this
    process's (the load generator, ``client``: on the same cores, not part of the stack)."""
    pids = {name: proc.pid for name, proc in stack.procs}
    if stack.redis_server is not None:
        pids["redis"] = stack.redis_server.process.pid
    return {name: cpu_split(pid) for name, pid in pids.items()} | {"client": client_cpu()}


def client_cpu() -> tuple[float, float]:
    """(CPU seconds of this process and of its children that ended: the client processes
    ``bench serve`` spawned and joined; the stack's, still running, are not among them, 0)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return cpu_split(os.getpid())[0] + children.ru_utime + children.ru_stime, 0.0


def worker_settings(engine_args: list[str], environ=None) -> LoadedSettings:
    """The settings a worker of the stack runs with: ``engine_args`` (flags of `tandem serve`,
    which the stack appends to each worker's) over the environment (``TANDEM_*``, and the
    ``TANDEM_CONFIG`` file) over the defaults, with where each came from. Raises SettingsError
    naming a bad setting, and SystemExit (argparse) on an unknown flag."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="--engine-args", add_help=False)
    add_setting_flags(parser, select=lambda path: path != "log_level" and not path.startswith("up."))
    flags = flag_values(parser.parse_args(engine_args))
    return load_settings(flags, environ.get("TANDEM_CONFIG"), environ)


def per_token(before: dict, after: dict, tokens: int) -> dict[str, float]:
    """CPU ms per output token: each process; workers split into model and serving;
    ``outside_model`` sums the stack's serving parts (not the client)."""
    out: dict[str, float] = {}
    for name in after:
        total = after[name][0] - before[name][0]
        engine = after[name][1] - before[name][1]
        if engine > 0:
            out[f"{name}.model"] = engine * 1e3 / tokens
            out[f"{name}.serving"] = (total - engine) * 1e3 / tokens
        else:
            out[name] = total * 1e3 / tokens
    out["outside_model"] = sum(v for k, v in out.items()
                               if not k.endswith(".model") and k != "client")
    return out


def load(args, stack: Stack, concurrency: int, out: Path) -> dict:
    target = (f"grpc://{stack.address}" if args.api == "grpc"
              else f"http://127.0.0.1:{args.http_port}/v1")
    name = f"serving-c{concurrency}"
    argv = ["--target", target, "--request-rate", "inf", "--max-concurrency", str(concurrency),
            "--num-prompts", str(args.num_prompts), "--dataset", "random", "--random-input-len",
            str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-warmups", "2", "--seed", "0", "--disable-progress", "--result-dir", str(out),
            "--result-name", name,
            # the stack's model's tokenizer (a random-weight checkpoint on a GPU machine)
            *(["--tokenizer", os.environ["TANDEM_MODEL"]]
              if os.environ.get("TANDEM_MODEL") else [])]
    if args.api == "http":
        argv += ["--endpoint", "completions"]
    else:
        argv += ["--client-processes", str(min(args.client_processes, concurrency)),
                 "--grpc-channels", str(args.grpc_channels)]
    before = sample(stack)
    t0 = time.perf_counter()
    if serve.main(argv) != 0:
        raise RuntimeError(f"{name}: bench serve failed")
    wall = time.perf_counter() - t0
    after = sample(stack)
    result = json.loads((out / f"{name}.json").read_text())
    tokens = result["total_output_tokens"]
    # the warm-up requests' tokens are in the CPU window too: count them
    tokens_in_window = tokens + 2 * args.output_len
    return {"concurrency": concurrency, "output_throughput": result["output_throughput"],
            "output_tokens": tokens, "wall_s": wall, "failed": result["failed"],
            "cpu_ms_per_token": per_token(before, after, tokens_in_window)}


def engine_rates(args, settings: Settings, batches: list[int]) -> dict[int, dict[str, float]]:
    """The in-process engine at each batch (``settings.engine``: the stack's workers' engine,
    its ``max_num_seqs`` the batch), two ways: the stack's own workload (``--num-prompts``
    random prompts of ``--input-len`` tokens, ``--output-len`` output tokens each, at most
    ``batch`` running: prefill included, as the stack does it; output tokens over wall time)
    and decode steps alone (``decode_rate``). One engine at a time: on a GPU each sizes its KV
    cache from the memory the last one gave back."""
    import gc
    import random

    import torch

    from scripts.bench_quant import decode_rate
    from services.engine.engine import LLMEngine
    from services.engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    rates = {}
    for b in batches:
        e = LLMEngine(settings.engine.engine_config().model_copy(update={"max_num_seqs": b}))
        e.warm_up()
        rng = random.Random(0)
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        t0, tokens = time.perf_counter(), 0
        for i in range(args.num_prompts):
            ids = [rng.randrange(17, e.model_config.vocab_size) for _ in range(args.input_len)]
            e.add_request(e.make_request(f"w{b}-{i}", ids, params))
        while e.has_work():
            tokens += sum(len(o.new_token_ids) for o in e.step())
        rates[b] = {"workload": tokens / (time.perf_counter() - t0),
                    "decode_only": decode_rate(e, b, args.output_len)["tok_per_s"]}
        del e
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_serving_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[16, 64])
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--api", choices=("grpc", "http"), default="grpc")
    p.add_argument("--engine-args", default="--quantization auto --max-num-seqs 64",
                   help="the workers' flags (`tandem serve`'s), which the in-process engine "
                   "takes too")
    p.add_argument("--client-processes", type=int, default=1,
                   help="gRPC: bench serve's --client-processes (at most the concurrency), so "
                   "that the client is not the bound where the engine is fast (a GPU)")
    p.add_argument("--grpc-channels", type=int, default=1,
                   help="gRPC: bench serve's --grpc-channels (connections of each client process)")
    p.add_argument("--skip-engine", action="store_true", help="no in-process comparison")
    p.add_argument("--out", default="bench-results/serving_cpu.json")
    args = p.parse_args(argv)
    engine_args = shlex.split(args.engine_args)
    loaded = worker_settings(engine_args)
    settings, cores = loaded.settings, usable_cores()
    layout = up_layout(loaded)  # tandem up's: its GPUs, and threads a --num-threads gives
    args.threads = max(layout.threads.values())
    out = Path(args.out).parent
    args.http_port = free_port() if args.api == "http" else 0
    stack = Stack(UpOptions(
        host="127.0.0.1", port=free_port(), num_prefill=layout.num_prefill,
        num_decode=layout.num_decode, num_unified=layout.num_unified, redis_url=None,
        worker_args=engine_args, threads=layout.threads,
        gateway_args=["--http-port", str(args.http_port)],
        num_gateways=layout.num_gateways, ready_timeout_s=600))
    stack.start()
    try:
        stack.wait_ready()
        rows = [load(args, stack, c, out) for c in args.concurrency]
    finally:
        stack.stop()
    rates = {} if args.skip_engine else engine_rates(args, settings, args.concurrency)
    print(f"layout {layout.describe()}; {args.api}; {settings.engine.model} on "
          f"{settings.engine.device.value}; CPU ms per output token")
    for r in rows:
        c = r["concurrency"]
        r["engine_tokens_per_s"] = rates.get(c)  # {"workload": ..., "decode_only": ...}
        r["stack_of_engine"] = (r["output_throughput"] / rates[c]["workload"]) if c in rates else None
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_ms_per_token"].items())
        ratio = (f" (engine in process: {rates[c]['workload']:.1f} on this workload, stack/engine "
                 f"{r['stack_of_engine']:.2f}; decode steps alone {rates[c]['decode_only']:.1f})"
                 if c in rates else "")
        failed = f", {r['failed']} requests FAILED" if r["failed"] else ""
        print(f"c{c}: {r['output_throughput']:.1f} tok/s{ratio}{failed}; CPU ms/token {parts}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(
        {"layout": described, "api": args.api, "cores": cores, "model": settings.engine.model,
         "device": settings.engine.device.value, "dtype": settings.engine.dtype.value,
         "client_processes": args.client_processes, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
