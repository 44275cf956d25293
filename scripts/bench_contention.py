"""Speed that survives a shared machine (issue 27): Tandem and an OpenAI-compatible peer, quiet
and beside busy-loop neighbours, at each concurrency, rows interleaved; and Tandem under a cgroup
CPU quota (a Kubernetes CPU limit) where this machine lets the script make one.

    python -m scripts.bench_contention [--peer http://127.0.0.1:8080/v1] [--concurrency 1,16] \\
        [--neighbours 0,1] [--quota 1.0] [--rounds 1] [--num-prompts 64] \\
        [--engine-args "--quantization auto"] [--result-dir bench-results/contention]

Tandem is `tandem up` on this machine's default layout, started as a child process and loaded
over its OpenAI HTTP API (as the peer is), with ``tandem bench serve``'s chat workload (all
requests at once under the concurrency cap, ``--chat-max-tokens`` output tokens at most). A
neighbour is ``python3 -c 'while True: pass'``: what a benchmark client, a sidecar or another
tenant's process does to a core. For every round, neighbour count and concurrency, each server
runs once, the order alternating between rounds. Under ``--quota Q`` a second Tandem stack is
started inside a new cgroup limited to Q CPUs (v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``) and
loaded quiet; without a writable cgroup hierarchy the script says so and skips it.

Prints a table (output tok/s, TPOT p50, TTFT p50, ITL p99, and each row's share of the same
server's quiet figure) and writes ``contention.json`` plus each run's ``bench serve`` JSON. The
peer is not started here: run it yourself on the same machine (llama.cpp's ``llama-server`` on
the same GGUF file, for example).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from loadtest import serve
from scripts.bench_layout import free_port

log = logging.getLogger("bench_contention")
FIGURES = ("output_throughput", "median_tpot_ms", "p50_ttft_ms", "p99_itl_ms", "completed",
           "failed", "duration")
BUSY_LOOP = "while True: pass"


class TandemUp:
    """``tandem up`` as a child process (in cgroup ``cgroup`` when given), ready on HTTP."""

    def __init__(self, engine_args: list[str], cgroup: Path | None = None) -> None:
        self.http_port, port = free_port(), free_port()
        argv = [sys.executable, "-m", "services.runtime.cli", "up", "--http-port", str(self.http_port),
                "--port", str(port), *engine_args]
        if cgroup is not None:  # the shell joins the group, then becomes `tandem up`
            argv = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *argv]
        # its log goes to a file: a pipe nobody reads fills (64 KiB) and then blocks the stack
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        self.url = f"http://127.0.0.1:{self.http_port}/v1"

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"tandem up exited {self.proc.returncode}: "
                                   f"{self.log.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/ready", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError("tandem up was not ready in time")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def make_cgroup(cpus: float) -> Path | None:
    """A new cgroup limited to ``cpus`` CPUs (period 100 ms), or None where none can be made."""
    name = f"tandem-bench-{os.getpid()}"
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v2 / "cgroup.controllers").exists():
            group = v2 / name
            group.mkdir()
            (group / "cpu.max").write_text(f"{int(cpus * 100_000)} 100000")
            return group
        v1 = v2 / "cpu"
        if (v1 / "cpu.cfs_quota_us").exists():
            group = v1 / name
            group.mkdir()
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text(str(int(cpus * 100_000)))
            return group
    except OSError as exc:
        log.warning("no cgroup with a CPU quota here (%s): the quota run is skipped", exc)
    return None


def load(args, url: str, concurrency: int, out: Path, name: str) -> dict:
    """One ``bench serve`` run against ``url``: its figures."""
    n = args.single_stream_prompts if concurrency == 1 else args.num_prompts
    argv = ["--target", url, "--endpoint", "chat", "--request-rate", "inf",
            "--max-concurrency", str(concurrency), "--num-prompts", str(n), "--dataset", "chat",
            "--chat-max-tokens", str(args.chat_max_tokens), "--num-warmups", "2",
            "--seed", str(args.seed), "--percentiles", "50,90,99", "--time-limit",
            str(args.time_limit), "--disable-progress", "--result-dir", str(out),
            "--result-name", name]
    if serve.main(argv) != 0:
        raise RuntimeError(f"{name}: bench serve failed")
    result = json.loads((out / f"{name}.json").read_text())
    return {k: result.get(k) for k in FIGURES}


def run_rounds(args, servers: dict[str, str], out: Path) -> list[dict]:
    """Every (round, neighbours, concurrency, server) row, servers alternating by round."""
    rows = []
    for r in range(args.rounds):
        order = list(servers) if r % 2 == 0 else list(reversed(servers))
        for n in args.neighbours:
            busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]
            try:
                for c in args.concurrency:
                    for server in order:
                        name = f"{server}-busy{n}-c{c}-r{r}"
                        log.info("%s", name)
                        rows.append({"server": server, "scenario": f"busy{n}", "concurrency": c,
                                     "round": r, **load(args, servers[server], c, out, name)})
            finally:
                for p in busy:
                    p.kill()
    return rows


def run_quota(args, out: Path) -> list[dict]:
    group = make_cgroup(args.quota)
    if group is None:
        return []
    stack = TandemUp(shlex.split(args.engine_args), group)
    try:
        stack.wait_ready()
        return [{"server": "tandem", "scenario": f"quota{args.quota:g}", "concurrency": c,
                 "round": 0, **load(args, stack.url, c, out, f"tandem-quota-c{c}")}
                for c in args.concurrency]
    finally:
        stack.stop()
        try:
            group.rmdir()
        except OSError as exc:
            log.warning("cgroup %s not removed: %s", group, exc)


def summarise(rows: list[dict]) -> list[dict]:
    """Mean figures per (server, scenario, concurrency), with the share of the same server's
    quiet tokens/s and TPOT."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["server"], row["scenario"], row["concurrency"]), []).append(row)
    mean = {k: {f: sum(r[f] or 0 for r in v) / len(v) for f in FIGURES} for k, v in groups.items()}
    table = []
    for (server, scenario, c), m in mean.items():
        quiet = mean.get((server, "busy0", c))
        table.append({"server": server, "scenario": scenario, "concurrency": c, **m,
                      "runs": len(groups[server, scenario, c]),
                      "tok_s_of_quiet": m["output_throughput"] / quiet["output_throughput"]
                      if quiet and quiet["output_throughput"] else None,
                      "tpot_of_quiet": m["median_tpot_ms"] / quiet["median_tpot_ms"]
                      if quiet and quiet["median_tpot_ms"] else None})
    return table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_contention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda t: [int(x) for x in t.split(",")]  # noqa: E731
    p.add_argument("--peer", default="", help="an OpenAI-compatible server's base URL, e.g. "
                   "http://127.0.0.1:8080/v1 (default: Tandem alone)")
    p.add_argument("--concurrency", type=ints, default=[1, 16])
    p.add_argument("--neighbours", type=ints, default=[0, 1], help="busy-loop processes beside "
                   "the servers, one scenario each (0: quiet)")
    p.add_argument("--quota", type=float, default=0.0, help="also run Tandem in a cgroup of "
                   "this many CPUs (0: no)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--single-stream-prompts", type=int, default=8)
    p.add_argument("--chat-max-tokens", type=int, default=128)
    p.add_argument("--engine-args", default="", help="extra `tandem up` flags")
    p.add_argument("--time-limit", type=float, default=900.0, help="seconds per bench serve run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", default="bench-results/contention")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    stack = TandemUp(shlex.split(args.engine_args))
    try:
        stack.wait_ready()
        servers = {"tandem": stack.url, **({"peer": args.peer} if args.peer else {})}
        rows = run_rounds(args, servers, out)
    finally:
        stack.stop()
    if args.quota:
        rows += run_quota(args, out)
    table = summarise(rows)
    print(f"\n{'server':<8}{'scenario':<10}{'conc':>5}{'tok/s':>9}{'of quiet':>9}{'TPOT p50':>10}"
          f"{'x quiet':>8}{'TTFT p50':>10}{'ITL p99':>9}")
    for t in table:
        share = f"{t['tok_s_of_quiet']:.2f}" if t["tok_s_of_quiet"] else "-"
        tpot = f"{t['tpot_of_quiet']:.2f}" if t["tpot_of_quiet"] else "-"
        print(f"{t['server']:<8}{t['scenario']:<10}{t['concurrency']:>5}"
              f"{t['output_throughput']:>9.1f}{share:>9}{t['median_tpot_ms']:>10.1f}{tpot:>8}"
              f"{t['p50_ttft_ms']:>10.1f}{t['p99_itl_ms']:>9.1f}")
    summary = {"config": vars(args), "cpu_count": os.cpu_count(),
               "affinity": len(os.sched_getaffinity(0)), "rows": rows, "table": table,
               "quota_ran": any(r["scenario"].startswith("quota") for r in rows)}
    (out / "contention.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out / 'contention.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
