"""Worker time-to-ready, end to end and phase by phase (``python -m scripts.bench_ready``).

Three measurements per precision (``--modes dtype:quantization,...``), each in a fresh process:

- ``phases``: where a worker's start goes, timed in-process with ``time.perf_counter`` (wall)
  and ``time.process_time`` (CPU of all threads, which a loaded machine inflates less):
  ``import_torch``, ``import_engine``, ``read_gguf`` (header and tensor map),
  ``build_model`` (weights, kernel load), ``kv_cache`` and the rest of the engine,
  ``warm_up``.
- ``worker_s`` / ``worker_cpu_s``: ``python -m services.runtime.cli serve decode`` from process start
  to gRPC health SERVING, wall, and the worker's CPU seconds by then (user + system of all its
  threads, ``/proc/PID/stat``); a private ``redis-server`` is started once for the run.
- ``unified_s`` / ``unified_cpu_s``: the same for ``serve unified``.
- ``up_s`` / ``up_cpu_s`` (``--up``): ``python -m services.runtime.cli up`` from process start to its
  "Tandem is up" log line (every worker registered, gateway SERVING), wall, and the CPU
  seconds of it and its children by then (``up_cpu_by_process``).

Prints a table and writes JSON (``--out``). Compare figures only within one run; on a shared
machine the CPU-time figures are the steadier ones.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from scripts.bench_layout import free_port

PHASES_CODE = r"""
import json, time
marks = [("start", time.perf_counter(), time.process_time())]
def mark(name):
    marks.append((name, time.perf_counter(), time.process_time()))
import torch
torch.set_num_threads({threads})
mark("import_torch")
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.quantized import build_model
from services.engine.quantized_loader import file_weight_formats
from services.engine.model_files import default_model_path
mark("import_engine")
path = str(default_model_path())
file_weight_formats(path)
mark("read_gguf")
import services.engine.engine as engine_module
built = {{}}
def timed_build(*args, **kw):
    out = build_model(*args, **kw)
    mark("build_model")
    return out
engine_module.build_model = timed_build
e = LLMEngine(EngineConfig(dtype={dtype!r}, quantization={quant!r}, num_kv_blocks={blocks}))
mark("kv_cache_and_engine")
e.warm_up()
mark("warm_up")
print(json.dumps({{"phases": {{n: {{"wall_s": w - pw, "cpu_s": c - pc}} for (n, w, c), (_, pw, pc)
                              in zip(marks[1:], marks)}},
                   "total_wall_s": marks[-1][1] - marks[0][1],
                   "total_cpu_s": marks[-1][2] - marks[0][2],
                   "resolved": e.precision.dtype + ":" + e.precision.quantization,
                   "weight_bytes": e.weight_bytes}}))
"""


def phases(dtype: str, quant: str, threads: int, blocks: int) -> dict:
    """One fresh interpreter timing each phase of an engine's start (see the module doc)."""
    code = PHASES_CODE.format(dtype=dtype, quant=quant, threads=threads, blocks=blocks)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                             timeout=0.5)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def _env(dtype: str, quant: str, threads: int) -> dict[str, str]:
    return {**os.environ, "TANDEM_DTYPE": dtype, "TANDEM_QUANTIZATION": quant,
            "TANDEM_NUM_THREADS": str(threads), "TANDEM_NUM_KV_BLOCKS": "1024"}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def worker_ready(redis_url: str, dtype: str, quant: str, threads: int, timeout_s: float,
                 role: str = "decode") -> tuple[float, float]:
    """(wall seconds, worker CPU seconds) from spawning one ``role`` worker to its health check
    answering SERVING."""
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "services.runtime.cli", "serve", role,
                             "--redis-url", redis_url, "--worker-port", str(port)],
                            env=_env(dtype, quant, threads), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while not _serving(f"127.0.0.1:{port}"):
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited {proc.returncode} (run it by hand to see why)")
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"worker not SERVING within {timeout_s:.0f}s")
            time.sleep(0.02)
        return time.perf_counter() - t0, _cpu_s(proc.pid)
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def up_ready(dtype: str, quant: str, threads: int, timeout_s: float) -> tuple[float, dict]:
    """(wall seconds, {process: CPU seconds}) from spawning ``tandem up`` to its "Tandem is up"
    line (own Redis included)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "services.runtime.cli", "up", "--port",
                             str(free_port())], env=_env(dtype, quant, threads),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if "Tandem is up" in line:
                wall = time.perf_counter() - t0
                cpu = {"up": _cpu_s(proc.pid)}
                for child in _children(proc.pid):
                    argv = Path(f"/proc/{child}/cmdline").read_text().split("\0")
                    name = argv[argv.index("serve") + 1] if "serve" in argv else Path(argv[0]).name
                    cpu[f"{name}-{child}"] = _cpu_s(child)
                return wall, cpu
            if time.perf_counter() - t0 > timeout_s:
                break
        raise RuntimeError(f"`tandem up` did not report ready (exit {proc.poll()})")
    finally:
        _stop(proc)


def run(args) -> dict:
    from services.state.redis_server import start_redis_server

    results = {}
    redis = start_redis_server()
    try:
        for spec in args.modes.split(","):
            dtype, quant = spec.split(":")
            row = {"phases": phases(dtype, quant, args.threads, 1024)}
            for role in ("decode", "unified"):
                runs = [worker_ready(redis.url, dtype, quant, args.threads, args.timeout_s, role)
                        for _ in range(args.repeat)]
                key = "worker" if role == "decode" else role
                row[key + "_s"], row[key + "_cpu_s"] = [r[0] for r in runs], [r[1] for r in runs]
            if args.up:
                row["up_s"], row["up_cpu_by_process"] = up_ready(dtype, quant, args.threads,
                                                                 args.timeout_s)
                row["up_cpu_s"] = sum(row["up_cpu_by_process"].values())
            results[spec] = row
            print(json.dumps({spec: row}), flush=True)
    finally:
        redis.stop()
    return results


def print_table(results: dict) -> None:
    names = list(next(iter(results.values()))["phases"]["phases"])
    print(f"{'mode':<18}" + "".join(f"{n[:12]:>13}" for n in names)
          + f"{'total':>8}{'decode':>8}{'unified':>8}{'up':>7}")
    nan = float("nan")
    for spec, r in results.items():
        ph = r["phases"]
        for kind in ("wall", "cpu"):
            cells = "".join(f"{ph['phases'][n][kind + '_s']:>13.2f}" for n in names)
            suffix = "_s" if kind == "wall" else "_cpu_s"  # min over the repeats
            tail = (f"{min(r['worker' + suffix]):>8.2f}{min(r['unified' + suffix]):>8.2f}"
                    f"{r.get('up' + suffix, nan):>7.2f}")
            print(f"{spec + ' ' + kind:<18}{cells}{ph['total_' + kind + '_s']:>8.2f}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_ready", description=__doc__)
    p.add_argument("--modes", default="float32:auto,float32:none",
                   help="comma-separated dtype:quantization")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--repeat", type=int, default=3, help="worker starts per mode (min reported)")
    p.add_argument("--up", action="store_true", help="also time `tandem up` (1 prefill + 1 decode)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--out", default="bench-results/ready.json")
    args = p.parse_args(argv)
    results = run(args)
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
