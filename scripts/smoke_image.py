"""Smoke test of the CPU image, run the way Kubernetes runs it (``scripts/build_image.sh`` calls
it after the build): Redis, a prefill worker, a decode worker and a gateway, each its own
container on one podman network, with ``k8s/base/config.yaml`` mounted as the ConfigMap is, the
secrets as files, a read-only root filesystem where only the image's declared volumes are
writable, every capability dropped, and the image's own user.

    .venv/bin/python -m scripts.smoke_image --image localhost/tandem:0.1.0-cpu --out bench-results

Checks, in order (the first failure stops it, exit status 1):

- each worker's gRPC health turns SERVING, the gateway's ``/health`` and ``/ready`` answer 200;
- every container runs as uid 10001 and cannot write its root filesystem; the image holds no C
  compiler and the workers compiled nothing (each logs its kernels as prebuilt, and
  ``/var/cache/tandem`` holds no kernel);
- ``POST /v1/chat/completions`` without the API key: 401; with it, greedy in the oracle mode
  (``float32``, quantization ``none``, set by env over the ConfigMap): the answer equals the
  transformers reference (``tests/data/hf_greedy.json``), 40 tokens;
- ``tandem up --chat`` in one container (its own ``redis-server`` and workers, no network but
  loopback) answers as transformers does, to the end of the turn, and exits 0;
- ``podman stop`` (SIGTERM, then SIGKILL after 90 s) drains every container to exit code 0.

Measures: the image's size by layer (``podman history``) and a worker's start-to-ready time,
from ``podman run`` to gRPC health SERVING, polled every 20 ms from the host, with the worker's
CPU seconds by then (``/proc/PID/stat``, its threads included: steadier than wall time on a
loaded machine): each oracle worker once, one at a time, then a decode worker in the default
precision (``auto``: the GGUF's Q4_1 weights in place) ``--repeat`` times, alone, each run
followed by the same worker started from this checkout's ``.venv`` (the interleaved
comparison). Writes ``OUT/image.json`` and prints a summary. Wall times include podman's
container start; on a shared machine they grow with its load (recorded as ``load_average``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
ULIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]
UID = "10001"
ORACLE = {"TANDEM_DTYPE": "float32", "TANDEM_QUANTIZATION": "none"}
ORACLE_FLAGS = ["--dtype", "float32", "--quantization", "none"]
EOS = 2  # <|im_end|>, the model's end of turn
CONFIG = "/etc/tandem/config.yaml"  # where the pods mount the ConfigMap


def serve_args(role: str) -> list[str]:
    """The container's arguments for ``role`` (after the image's ENTRYPOINT, ``tandem``), as
    ``k8s/base`` gives them."""
    return ["serve", role, "--config", CONFIG]


class SmokeFailure(Exception):
    pass


def podman(*args: str, check: bool = True, timeout: float = 300) -> str:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise SmokeFailure(f"podman {' '.join(args[:3])}...: {proc.stderr.strip()}")
    return proc.stdout.strip()


def check(ok: bool, what: str) -> None:
    print(f"  {'ok ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        raise SmokeFailure(what)


class Stack:
    """The containers of one run, named ``tandem-smoke-<pid>-<role>``, on their own network."""

    def __init__(self, image: str, secrets_dir: Path) -> None:
        self.image, self.secrets_dir = image, secrets_dir
        self.prefix = f"tandem-smoke-{os.getpid()}"
        self.network = self.prefix
        self.names: list[str] = []
        self.redis_password = secrets.token_hex(16)
        podman("network", "create", self.network)

    def name(self, role: str) -> str:
        return f"{self.prefix}-{role}"

    def run(self, role: str, args: list[str], env: dict[str, str] | None = None,
            ports: tuple[int, ...] = (), entrypoint: str | None = None) -> str:
        """Start a container the way the pod spec does; returns its name."""
        name = self.name(role)
        cmd = ["run", "-d", "--name", name, "--network", self.network, *ULIMITS,
               "--read-only", "--read-only-tmpfs=false", "--cap-drop", "ALL",
               "--security-opt", "no-new-privileges",
               "-v", f"{ROOT / 'k8s/base/config.yaml'}:{CONFIG}:ro",
               "-v", f"{self.secrets_dir}:/etc/tandem/secrets:ro"]
        for port in ports:
            cmd += ["-p", f"127.0.0.1::{port}"]
        for key, value in (env or {}).items():
            cmd += ["-e", f"{key}={value}"]
        if entrypoint:
            cmd += ["--entrypoint", entrypoint]
        podman(*cmd, self.image, *args)
        self.names.append(name)
        return name

    def worker_env(self, role: str) -> dict[str, str]:
        return {"REDIS_URL": self.redis_url, "TANDEM_ADVERTISE_HOST": self.name(role),
                "TANDEM_WORKER_ID": f"{role}-0", "TANDEM_NUM_THREADS": "1",
                "OMP_NUM_THREADS": "1",
                "TANDEM_INTERNAL_SECRET_FILE": "/etc/tandem/secrets/internal-secret"}

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.redis_password}@{self.name('redis')}:6379/0"

    def host_port(self, name: str, port: int) -> int:
        return int(podman("port", name, f"{port}/tcp").rsplit(":", 1)[1])

    def stop(self, name: str, timeout_s: int = 90) -> int:
        """SIGTERM, SIGKILL after ``timeout_s``; the container's exit code."""
        podman("stop", "-t", str(timeout_s), name, timeout=timeout_s + 60)
        return int(podman("inspect", "--format", "{{.State.ExitCode}}", name))

    def logs(self, name: str) -> str:
        proc = subprocess.run(["podman", "logs", name], capture_output=True, text=True)
        return proc.stdout + proc.stderr

    def close(self) -> None:
        for name in reversed(self.names):
            podman("rm", "-f", "-v", name, check=False)
        podman("network", "rm", "-f", self.network, check=False)


def wait_serving(port: int, timeout_s: float = 300.0) -> float:
    """Seconds until gRPC health on 127.0.0.1:``port`` says SERVING, polled every 20 ms."""
    start = time.monotonic()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() - start < timeout_s:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - start
            except grpc.RpcError:
                pass
            time.sleep(0.02)
    raise SmokeFailure(f"port {port}: not SERVING within {timeout_s:.0f} s")


def http(url: str, body: dict | None = None, key: str | None = None,
         timeout_s: float = 300) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def wait_http_ok(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if http(url, timeout_s=5)[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    raise SmokeFailure(f"{url}: not 200 within {timeout_s:.0f} s")


def layers(image: str) -> tuple[int, list[dict]]:
    """(image size in bytes, its layers: size and the instruction that made each)."""
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image))
    history = json.loads(podman("history", "--format", "json", image))
    rows = [{"size_bytes": int(h.get("size", 0)),
             "created_by": re.sub(r"\s+", " ", h.get("CreatedBy", h.get("created_by", "")))[:160]}
            for h in history]
    return size, [r for r in rows if r["size_bytes"] > 0]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_worker(stack: Stack, role: str, env: dict[str, str]) -> tuple[str, dict]:
    """Start a worker container and wait until it serves; (name, {"wall_s": from ``podman
    run`` to SERVING, "cpu_s": the worker's CPU seconds by then})."""
    start = time.monotonic()
    name = stack.run(role, serve_args(role.split("-")[0]), env, ports=(50061,))
    started = time.monotonic() - start
    wait_serving(stack.host_port(name, 50061))
    wall = time.monotonic() - start
    pid = int(podman("inspect", "--format", "{{.State.Pid}}", name))
    cpu = cpu_seconds(pid)
    engine = re.findall(r"engine ready in ([\d.]+)s|engine warmed up in ([\d.]+)s", stack.logs(name))
    return name, {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                  "podman_run_s": round(started, 3),
                  "engine_ready_s": float(next((a for a, _ in engine if a), "nan")),
                  "warm_up_s": float(next((b for _, b in engine if b), "nan"))}


def start_checkout_worker(redis_url: str, env: dict[str, str]) -> tuple[subprocess.Popen, dict]:
    """The same decode worker from this checkout's .venv (no container), for comparison."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    environ = {**os.environ, **env, "REDIS_URL": redis_url, "TANDEM_ADVERTISE_HOST": "127.0.0.1"}
    environ.pop("TANDEM_INTERNAL_SECRET_FILE", None)
    start = time.monotonic()
    proc = subprocess.Popen([str(ROOT / ".venv/bin/tandem"), "serve", "decode", "--config",
                             str(ROOT / "k8s/base/config.yaml"), "--host", "127.0.0.1",
                             "--worker-port", str(port), "--kv-port", "0", "--metrics-port", "0"],
                            env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    wait_serving(port)
    return proc, {"wall_s": round(time.monotonic() - start, 3),
                  "cpu_s": round(cpu_seconds(proc.pid), 3)}


def kernels_line(log_text: str) -> str:
    return next((ln for ln in log_text.splitlines() if "CPU kernels" in ln
                 or "CPU KERNELS NOT LOADED" in ln), "")


def smoke(image: str, repeat: int) -> dict:
    from tests.reference import CHAT_PROMPTS, NUM_TOKENS, chat_prompt_ids, hf_greedy_outputs, tokenizer

    result: dict = {"image": image}
    size, rows = layers(image)
    result.update(size_bytes=size, layers=rows)
    print(f"image {image}: {size / 1e6:.0f} MB in {len(rows)} non-empty layers")
    for row in rows:
        print(f"  {row['size_bytes'] / 1e6:9.1f} MB  {row['created_by'][:110]}")

    api_key = secrets.token_hex(32)
    with tempfile.TemporaryDirectory() as tmp:
        secrets_dir = Path(tmp) / "secrets"
        secrets_dir.mkdir(mode=0o755)
        (secrets_dir / "internal-secret").write_text(secrets.token_hex(32))
        (secrets_dir / "api-keys").write_text(hashlib.sha256(api_key.encode()).hexdigest() + " smoke\n")
        for f in secrets_dir.iterdir():
            f.chmod(0o644)  # readable by the image's user, as a Secret volume's default mode
        os.chmod(tmp, 0o755)
        stack = Stack(image, secrets_dir)
        try:
            result.update(run_stack(stack, api_key, repeat, CHAT_PROMPTS[0], NUM_TOKENS,
                                    chat_prompt_ids, hf_greedy_outputs, tokenizer))
        finally:
            stack.close()
    return result


def run_stack(stack: Stack, api_key: str, repeat: int, prompt: str, num_tokens: int,
              chat_prompt_ids, hf_greedy_outputs, tokenizer) -> dict:
    out: dict = {"ready_s": {}}
    print("containers")
    redis = stack.run("redis", ["--port", "6379", "--save", "", "--appendonly", "no",
                                "--requirepass", stack.redis_password],
                      entrypoint="redis-server", ports=(6379,))
    deadline = time.monotonic() + 60
    while podman("exec", redis, "redis-cli", "-a", stack.redis_password, "--no-auth-warning",
                 "ping", check=False) != "PONG":
        if time.monotonic() > deadline:
            raise SmokeFailure("redis: no PONG within 60 s")
        time.sleep(0.2)
    check(True, "redis-server (from the image) answers PING")

    # the oracle workers one at a time, so neither's start time includes the other's
    names = {}
    for role in ("decode", "prefill"):
        names[role], times = start_worker(stack, role, {**stack.worker_env(role), **ORACLE})
        out["ready_s"][f"{role}_oracle"] = times
        check(True, f"{role} worker (float32, quantization none) gRPC SERVING "
                    f"{times['wall_s']:.2f} s after podman run ({times['cpu_s']:.2f} CPU s)")
    gateway = stack.run("gateway", serve_args("gateway"), {
        "REDIS_URL": stack.redis_url, "TANDEM_HTTP_PORT": "8000", "TANDEM_NUM_THREADS": "1",
        "TANDEM_INTERNAL_SECRET_FILE": "/etc/tandem/secrets/internal-secret",
        "TANDEM_API_KEYS_FILE": "/etc/tandem/secrets/api-keys"}, ports=(8000, 50051))
    names["gateway"] = gateway
    base = f"http://127.0.0.1:{stack.host_port(gateway, 8000)}"
    wait_http_ok(f"{base}/health")
    check(True, "gateway GET /health 200")
    wait_http_ok(f"{base}/ready")
    check(True, "gateway GET /ready 200 (a prefill and a decode worker registered, Redis answers)")

    print("the container as the pod runs it")
    for role, name in {"redis": stack.name("redis"), **names}.items():
        uid = podman("exec", name, "id", "-u")
        check(uid == UID, f"{role}: runs as uid {uid}")
        writes = subprocess.run(["podman", "exec", name, "touch", "/opt/tandem/probe"],
                                capture_output=True, text=True)
        check(writes.returncode != 0 and "Read-only file system" in writes.stderr,
              f"{role}: root filesystem is read-only ({writes.stderr.strip()})")
    compilers = podman("exec", gateway, "sh", "-c", "command -v cc gcc clang || true")
    check(compilers == "", f"no C compiler in the image ({compilers or 'none found'})")
    for role in ("decode", "prefill"):
        line = kernels_line(stack.logs(names[role]))
        check("prebuilt for" in line and "built here" not in line and "NOT LOADED" not in line,
              f"{role}: kernels prebuilt, none compiled ({line.split('CPU kernels')[-1][:120]})")
        cached = podman("exec", names[role], "sh", "-c", "ls /var/cache/tandem")
        check("kernels" not in cached.split(), f"{role}: no kernel cache written ({cached!r})")
    out["kernels"] = kernels_line(stack.logs(names["decode"]))

    print("requests")
    body = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": num_tokens,
            "ignore_eos": True, "messages": [{"role": "user", "content": prompt}]}
    status, _ = http(f"{base}/v1/chat/completions", body)
    check(status == 401, f"POST /v1/chat/completions without the API key: {status}")
    status, answer = http(f"{base}/v1/chat/completions", body, key=api_key)
    check(status == 200, f"POST /v1/chat/completions with the key: {status}")
    expected = tokenizer().decode(list(hf_greedy_outputs()[0][:num_tokens]))
    text = answer["choices"][0]["message"]["content"]
    out["answer"] = text
    check(text == expected, f"greedy answer equals transformers' ({num_tokens} tokens): "
                            f"{text[:60]!r}...")
    usage = answer["usage"]
    check(usage["completion_tokens"] == num_tokens
          and usage["prompt_tokens"] == len(chat_prompt_ids(prompt)),
          f"usage: {usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens")

    print("start-to-ready of a decode worker in the default precision, alone; interleaved with "
          "the same worker from this checkout")
    redis_host = f"redis://:{stack.redis_password}@127.0.0.1:{stack.host_port(redis, 6379)}/0"
    image_runs, checkout_runs = [], []
    for i in range(repeat):
        name, times = start_worker(stack, f"decode-auto{i}", stack.worker_env(f"decode-auto{i}"))
        image_runs.append(times)
        logs = stack.logs(name)
        precision = next((ln for ln in logs.splitlines() if "model precision" in ln), "")
        check("prebuilt for" in kernels_line(logs),
              f"image decode (auto) #{i + 1}: SERVING {times['wall_s']:.2f} s after podman run, "
              f"{times['cpu_s']:.2f} CPU s; {precision.split('model precision:')[-1][:46].strip()}")
        exit_code = stack.stop(name)
        check(exit_code == 0, f"image decode (auto) #{i + 1}: SIGTERM, exit code {exit_code}")
        proc, times = start_checkout_worker(redis_host, {
            **stack.worker_env(f"checkout{i}"), "TANDEM_WORKER_ID": f"checkout-{i}"})
        checkout_runs.append(times)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        check(code == 0, f"checkout decode (auto) #{i + 1}: SERVING {times['wall_s']:.2f} s after "
                         f"start, {times['cpu_s']:.2f} CPU s; SIGTERM, exit code {code}")
    out["ready_s"]["decode_auto"] = image_runs
    out["ready_s"]["checkout_decode_auto"] = checkout_runs
    for key, runs in (("decode_auto", image_runs), ("checkout_decode_auto", checkout_runs)):
        out["ready_s"][f"{key}_median"] = {
            m: statistics.median(r[m] for r in runs) for m in ("wall_s", "cpu_s")}
    out["load_average"] = os.getloadavg()

    print("the whole stack in one container: tandem up (its own redis-server), oracle mode")
    reference = list(hf_greedy_outputs()[0])
    answer_ids = reference[:reference.index(EOS)]  # `up --chat` stops at the end of the turn
    proc = subprocess.run(["podman", "run", "--rm", *ULIMITS, "--read-only", "--read-only-tmpfs=false",
                           "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                           "--network", "none", stack.image, "up", "--chat", prompt,
                           "--temperature", "0", *ORACLE_FLAGS],
                          capture_output=True, text=True, timeout=900)
    expected = f">>> {prompt}\n{tokenizer().decode(answer_ids)}\n[finish_reason=stop"
    out["up"] = {"exit_code": proc.returncode, "stdout": proc.stdout}
    check(proc.returncode == 0 and expected in proc.stdout,
          f"tandem up --chat: exit code {proc.returncode}, answer "
          f"{proc.stdout.splitlines()[1:2] or proc.stderr[-300:]}")

    print("SIGTERM drains (gateway first, as tandem up and a rolling update do)")
    out["exit_codes"] = {}
    for role in ("gateway", "prefill", "decode"):
        start = time.monotonic()
        code = stack.stop(names[role])
        out["exit_codes"][role] = code
        check(code == 0, f"{role}: exit code {code} after {time.monotonic() - start:.1f} s")
    code = stack.stop(stack.name("redis"))
    out["exit_codes"]["redis"] = code
    check(code == 0, f"redis: exit code {code}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default="localhost/tandem:0.1.0-cpu")
    parser.add_argument("--repeat", type=int, default=3,
                        help="starts of the default-precision decode worker (default 3)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="folder of image.json (default bench-results)")
    args = parser.parse_args(argv)
    try:
        result = smoke(args.image, args.repeat)
    except SmokeFailure as exc:
        print(f"smoke_image: FAILED: {exc}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "image.json").write_text(json.dumps(result, indent=1) + "\n")
    image, checkout = (result["ready_s"][k] for k in ("decode_auto_median",
                                                      "checkout_decode_auto_median"))
    print(f"smoke_image: passed; a decode worker (auto precision) is ready {image['wall_s']:.2f} s "
          f"after podman run, {image['cpu_s']:.2f} CPU s (from the checkout: {checkout['wall_s']:.2f}"
          f" s, {checkout['cpu_s']:.2f} CPU s; medians of {args.repeat}, load average "
          f"{result['load_average'][0]:.1f}); wrote {args.out / 'image.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
