"""Realise the rendered ``k8s/overlays/cpu`` on this machine (issue 14): every Deployment and
StatefulSet runs as a local process with its container's command, args and environment as the
pod would get them; the test waits on each manifest's OWN probes (gRPC health, httpGet, exec,
tcpSocket, with their periods and thresholds) and sends a real chat request through the
gateway Service's port.

What a pod has that this machine does not is mapped, each mapping named where it is made:

- pod network: every pod's container ports become free loopback ports (all pods share one
  host here, so two pods' ``50061`` cannot both be bound); a setting or env value equal to a
  container port is rewritten to that pod's local port; ``host`` (0.0.0.0 in the ConfigMap)
  becomes 127.0.0.1 so nothing listens beyond loopback;
- downward API ``fieldRef`` values: ``status.podIP`` -> 127.0.0.1, ``metadata.name`` -> a pod
  name like the Deployment's;
- Service DNS names (``tandem-redis:6379``) -> 127.0.0.1 and the selected pod's local port;
- mounted ConfigMap/Secret files -> files in a temp dir with the same keys (Secret values are
  test values); emptyDirs -> temp dirs; mount paths in args and env rewritten to them;
- the image's ENTRYPOINT ``tandem`` -> ``python -m services.runtime.cli`` of this checkout (the
  console script points elsewhere); ``redis:7.4-alpine``'s ``redis-server`` -> this machine's;
- threads: the manifests request 2-4 CPUs per worker; this shared 2-core machine cannot give
  them, so TANDEM_NUM_THREADS / OMP_NUM_THREADS are capped at 1;
- precision: the manifests leave it to ``auto`` (quantized on CPUs); the workers here run the
  oracle mode (TANDEM_DTYPE=float32, TANDEM_QUANTIZATION=none) so the answer can be checked
  token for token against transformers' greedy reference.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.runtime.process import die_with_parent
from tests.integration.conftest import free_port
from tests.reference import CHAT_PROMPTS, hf_greedy_outputs, tokenizer

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("kubectl") is None,
                                 reason="kubectl not on PATH: cannot render k8s/overlays/cpu")]

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "realise-api-key"  # what a client sends; the Secret holds its SHA-256 (gateway.api_keys_file)
SECRET_VALUES = {"redis-password": "realise-redis-password", "internal-secret": "realise-internal",
                 "api-keys": hashlib.sha256(API_KEY.encode()).hexdigest()}
ENTRYPOINT = {"tandem": [sys.executable, "-m", "services.runtime.cli"]}  # the image's ENTRYPOINT
MAX_THREADS = 1
CHAT_TOKENS = 8


class Pod:
    """One workload's pod as a local process."""

    def __init__(self, obj: dict, objs: list[dict], work: Path) -> None:
        self.obj, self.name = obj, f"{obj['metadata']['name']}-0"
        self.spec = obj["spec"]["template"]["spec"]
        self.container = self.spec["containers"][0]
        self.labels = obj["spec"]["template"]["metadata"]["labels"]
        self.ports = {p["containerPort"]: free_port() for p in self.container.get("ports", [])}
        self.port_names = {p["name"]: p["containerPort"] for p in self.container.get("ports", [])}
        self.dir = work / self.name
        self.mounts = self._mount_volumes(objs)
        self.proc: subprocess.Popen | None = None

    def port(self, ref) -> int:
        """The local port of a container port given by number or name."""
        return self.ports[self.port_names.get(ref, ref)]

    def _mount_volumes(self, objs: list[dict]) -> dict[str, str]:
        """mountPath -> local path, with the ConfigMap's and Secret's data written there."""
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        mounts = {}
        for m in self.container.get("volumeMounts", []):
            v, local = volumes[m["name"]], self.dir / m["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in v:
                [cm] = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == v["configMap"]["name"]]
                for key, text in cm["data"].items():
                    (local / key).write_text(text)
            elif "secret" in v:
                for item in v["secret"]["items"]:
                    (local / item["path"]).write_text(SECRET_VALUES[item["key"]] + "\n")
            mounts[m["mountPath"]] = str(local / m["subPath"]) if "subPath" in m else str(local)
        return mounts

    def local(self, text: str, services: dict[str, str]) -> str:
        """``text`` with mount paths, Service DNS names and container ports made local."""
        if self.mounts:  # one pass, longest first: a local path is never mapped again
            paths = "|".join(re.escape(p) for p in sorted(self.mounts, key=len, reverse=True))
            text = re.sub(rf"(?<![\w.-])({paths})(?=/|$|\s)", lambda m: self.mounts[m.group(1)], text)
        for dns, address in services.items():
            text = text.replace(dns, address)
        return self.ports.get(int(text), text) if text.isdigit() else text

    def env(self, services: dict[str, str]) -> dict[str, str]:
        """The container's environment as the kubelet builds it (``$(VAR)`` expanded)."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("TANDEM_") and k not in ("REDIS_URL", "OMP_NUM_THREADS")}
        for e in self.container.get("env", []):
            if "valueFrom" in e:
                src = e["valueFrom"]
                if "fieldRef" in src:
                    value = {"status.podIP": "127.0.0.1", "metadata.name": self.name}[src["fieldRef"]["fieldPath"]]
                else:
                    value = SECRET_VALUES[src["secretKeyRef"]["key"]]
            else:
                value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
            env[e["name"]] = str(self.local(value, services))
        for name in ("TANDEM_NUM_THREADS", "OMP_NUM_THREADS"):
            if name in env:
                env[name] = str(min(int(env[name]), MAX_THREADS))
        env.update(TANDEM_DTYPE="float32", TANDEM_QUANTIZATION="none")
        return env

    def argv(self, services: dict[str, str], env: dict[str, str]) -> list[str]:
        command = self.container.get("command") or ["tandem"]
        args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in self.container.get("args", [])]
        # NOTE: only the container's own words are mapped: this machine's interpreter may live
        # under a path the pod mounts (a checkout in /tmp, where the pod has an emptyDir)
        entrypoint = ENTRYPOINT.get(command[0], [shutil.which(command[0])])
        return [*entrypoint, *(str(self.local(a, services)) for a in [*command[1:], *args])]

    def start(self, services: dict[str, str]) -> None:
        env = self.env(services)
        if self.labels["app.kubernetes.io/component"] == "redis":
            # the pod's loopback stands in for its network; /data is an emptyDir
            argv = self.argv(services, env) + ["--bind", "127.0.0.1"]
        else:
            # pod network -> loopback: listen there, on this pod's local ports
            env.update(TANDEM_HOST="127.0.0.1", **self._port_settings())
            argv = self.argv(services, env)
        self.log = open(self.dir / "log.txt", "wb")
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent)
        self.env_used = env

    def _port_settings(self) -> dict[str, str]:
        """The ConfigMap's port settings -> this pod's local ports (each must be a declared
        container port: that agreement is what ``test_k8s_manifests`` checks)."""
        config = yaml.safe_load(Path(self.mounts["/etc/tandem/config.yaml"]).read_text())
        role = self.labels["app.kubernetes.io/component"]
        wanted = ({"TANDEM_PORT": config["gateway"]["port"]} if role == "gateway" else
                  {"TANDEM_WORKER_PORT": config["worker"]["port"], "TANDEM_KV_PORT": config["worker"]["kv_port"]})
        return {k: str(self.ports[v]) for k, v in wanted.items()}

    def tail(self) -> str:
        return (self.dir / "log.txt").read_bytes()[-3000:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.log.close()


def probe_once(pod: Pod, probe: dict) -> bool:
    """One run of a Kubernetes probe against the local pod."""
    timeout = probe.get("timeoutSeconds", 1)
    try:
        if "grpc" in probe:
            with grpc.insecure_channel(f"127.0.0.1:{pod.port(probe['grpc']['port'])}") as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=timeout)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
        if "httpGet" in probe:
            url = f"http://127.0.0.1:{pod.port(probe['httpGet']['port'])}{probe['httpGet'].get('path', '/')}"
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return 200 <= resp.status < 400
        if "tcpSocket" in probe:
            with socket.create_connection(("127.0.0.1", pod.port(probe["tcpSocket"]["port"])), timeout):
                return True
        if "exec" in probe:
            cmd = [str(pod.local(a, {})) for a in probe["exec"]["command"]]
            cmd = [re.sub(r"\b(\d{2,5})\b", lambda m: str(pod.ports.get(int(m.group(1)), m.group(1))), a) for a in cmd]
            return subprocess.run(cmd, env=pod.env_used, timeout=timeout, capture_output=True).returncode == 0
    except (grpc.RpcError, OSError, urllib.error.URLError, subprocess.TimeoutExpired):
        return False
    raise AssertionError(f"{pod.name}: probe kind not handled: {probe}")


def wait_probe(pod: Pod, kind: str) -> None:
    """Run ``pod``'s ``kind`` probe as the kubelet does: every periodSeconds; it passes on
    successThreshold successes, fails after failureThreshold failures in a row."""
    probe = pod.container[kind]
    period, failures = probe.get("periodSeconds", 10), 0
    while not probe_once(pod, probe):
        failures += 1
        assert pod.proc.poll() is None, f"{pod.name} exited ({pod.proc.returncode}):\n{pod.tail()}"
        assert failures < probe.get("failureThreshold", 3), \
            f"{pod.name}: {kind} failed {failures} times every {period}s:\n{pod.tail()}"
        time.sleep(period)


def service_addresses(objs: list[dict], pods: list[Pod], namespace: str) -> dict[str, str]:
    """``name:port`` (short and cluster DNS) of every Service -> 127.0.0.1:local port of the pod
    it selects (headless pool Services included)."""
    out = {}
    for svc in (o for o in objs if o["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        [pod] = [p for p in pods if all(p.labels.get(k) == v for k, v in sel.items())]
        for port in svc["spec"]["ports"]:
            local = f"127.0.0.1:{pod.port(port.get('targetPort', port['port']))}"
            name = svc["metadata"]["name"]
            for dns in (f"{name}.{namespace}.svc.cluster.local", f"{name}.{namespace}.svc", name):
                out[f"{dns}:{port['port']}"] = local
    return dict(sorted(out.items(), key=lambda kv: -len(kv[0])))  # longest names first


def test_overlay_cpu_runs_as_rendered_and_serves_a_chat_request(tmp_path):
    rendered = subprocess.run(["kubectl", "kustomize", str(ROOT / "k8s" / "overlays" / "cpu")],
                              capture_output=True, text=True, timeout=300)
    assert rendered.returncode == 0, rendered.stderr
    objs = [o for o in yaml.safe_load_all(rendered.stdout) if o]
    namespace = next(o["metadata"]["name"] for o in objs if o["kind"] == "Namespace")
    assert "ENTRYPOINT [\"tandem\"]" in (ROOT / "Dockerfile").read_text()
    workloads = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    pods = [Pod(o, objs, tmp_path) for o in workloads]
    by_role = {p.labels["app.kubernetes.io/component"]: p for p in pods}
    assert set(by_role) == {"redis", "gateway", "prefill", "decode"}, set(by_role)
    services = service_addresses(objs, pods, namespace)
    try:
        for role in ("redis", "decode", "prefill", "gateway"):  # as the kubelet would, any order
            by_role[role].start(services)
        for role in ("redis", "decode", "prefill", "gateway"):
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in by_role[role].container:
                    wait_probe(by_role[role], kind)
        gateway_http = services["tandem-gateway:8000"]
        body = json.dumps({"messages": [{"role": "user", "content": CHAT_PROMPTS[0]}],
                           "max_tokens": CHAT_TOKENS, "temperature": 0, "ignore_eos": True}).encode()
        url = f"http://{gateway_http}/v1/chat/completions"
        anonymous = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:  # the Secret's key is required
            urllib.request.urlopen(anonymous, timeout=120)
        assert refused.value.code == 401
        req = urllib.request.Request(url, data=body, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
        expected = tokenizer().decode(list(hf_greedy_outputs()[0][:CHAT_TOKENS]))
        assert answer["choices"][0]["message"]["content"] == expected, answer
        assert answer["usage"]["completion_tokens"] == CHAT_TOKENS
    finally:
        for role in ("gateway", "prefill", "decode", "redis"):  # gateway first: it drains
            by_role[role].stop()
    for pod in pods:
        assert pod.proc.returncode == 0, f"{pod.name} exited {pod.proc.returncode}:\n{pod.tail()}"
