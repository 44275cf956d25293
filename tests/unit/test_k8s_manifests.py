"""k8s/: every overlay renders with `kubectl kustomize`, validates strictly against the Kubernetes
schema (kubernetes-validate), and the rendered objects hold the deployment's properties: probes,
resources, restricted security contexts, NetworkPolicies and Services that select real pods,
ports that agree across Service, container and config, Secrets referenced and never inlined."""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
import jsonschema  # noqa: E402  (kubernetes-validate's own dependency)
pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl not on PATH: cannot render k8s/ with `kubectl kustomize`")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
K8S_VERSION = "1.37"
OVERLAYS = ["cpu", "gpu", "production", "observability"]
# Components combined the way a user would (every component used somewhere is rendered).
COMBOS = {"gpu+production+observability": ("overlays/gpu", ["production", "observability"]),
          "cpu+external-redis": ("overlays/cpu", ["external-redis"])}
TARGETS = [*OVERLAYS, "loadtest", *COMBOS]
_OBJ = {"type": "object"}
# The custom resources' specs, field names from KEDA's and the Prometheus Operator's CRDs (only
# the fields these manifests may use; an unknown or misspelt field fails like strict mode).
CRDS = {
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object", "additionalProperties": False,
        "required": ["scaleTargetRef", "triggers"],
        "properties": {
            "scaleTargetRef": {"type": "object", "additionalProperties": False, "required": ["name"],
                               "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                              "name": {"type": "string"}}},
            "pollingInterval": {"type": "integer"}, "cooldownPeriod": {"type": "integer"},
            "minReplicaCount": {"type": "integer"}, "maxReplicaCount": {"type": "integer"},
            "fallback": _OBJ, "advanced": _OBJ,
            "triggers": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["type", "metadata"],
                "properties": {"type": {"enum": ["prometheus", "cpu", "memory"]},
                               "name": {"type": "string"}, "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                               "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                               "authenticationRef": _OBJ}}}}},
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
        "properties": {
            "selector": _OBJ, "namespaceSelector": _OBJ, "jobLabel": {"type": "string"},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["port"],
                "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                               "interval": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                               "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"}}}}}},
}
WORKLOADS = ("Deployment", "StatefulSet", "Job")
ROLES = ("gateway", "prefill", "decode")
SECRET = "tandem-secrets"


def kustomize(paths: dict[str, Path]) -> dict[str, list[dict]]:
    """``kubectl kustomize`` of each path (run side by side); the objects of each rendering."""
    procs = {name: subprocess.Popen(["kubectl", "kustomize", str(path)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, path in paths.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"kubectl kustomize {paths[name]}: {stderr}"
        out[name] = [d for d in yaml.safe_load_all(stdout) if d]
    return out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    paths = {name: K8S / "overlays" / name for name in OVERLAYS}
    paths["loadtest"] = K8S / "loadtest"
    for name, (base, components) in COMBOS.items():
        d = tmp_path_factory.mktemp(name.replace("+", "-"))
        rel = os.path.relpath(K8S, d)
        (d / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "namespace": "tandem", "resources": [f"{rel}/{base}"],
            "components": [f"{rel}/components/{c}" for c in components]}))
        paths[name] = d
    return kustomize(paths)


_VALID: set[str] = set()


def validate_strict(o: dict) -> None:
    """kubernetes-validate in strict mode (unknown fields fail); each distinct object once."""
    key = json.dumps(o, sort_keys=True)
    if key not in _VALID:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)  # raises ValidationError
        _VALID.add(key)


# ------------------------------------------------------------------------------- helpers
def of_kind(objs: list[dict], *kinds: str) -> list[dict]:
    return [o for o in objs if o["kind"] in kinds]


def pod_spec(o: dict) -> dict:
    return o["spec"]["template"]["spec"]


def pod_labels(o: dict) -> dict:
    return o["spec"]["template"]["metadata"].get("labels", {})


def role(o: dict) -> str | None:
    return pod_labels(o).get("app.kubernetes.io/component") if o["kind"] in WORKLOADS else None


def tandem_workloads(objs: list[dict]) -> list[dict]:
    return [o for o in of_kind(objs, "Deployment") if role(o) in ROLES]


def selects(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def env_value(container: dict, name: str) -> str:
    return env_of(container)[name]["value"]


def ports_of(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def config_of(objs: list[dict], workload: dict) -> dict:
    """The Tandem config file a workload's container reads (`--config PATH` -> mount -> ConfigMap)."""
    c = pod_spec(workload)["containers"][0]
    path = c["args"][c["args"].index("--config") + 1]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == path)
    volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"])
    cm = next(o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"] == volume["configMap"]["name"])
    return yaml.safe_load(cm["data"][mount["subPath"]])


# ------------------------------------------------------------------------------- schema
@pytest.mark.parametrize("target", TARGETS)
def test_renders_and_validates_strictly(rendered, target):
    objs = rendered[target]
    ids = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(ids) == len(set(ids)), f"duplicate objects: {ids}"
    for o in objs:
        if (o["apiVersion"], o["kind"]) in CRDS:
            jsonschema.validate(o["spec"], CRDS[o["apiVersion"], o["kind"]])
        else:
            validate_strict(o)
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == "tandem", f"{o['kind']} {o['metadata']['name']}"
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tandem", o["metadata"]["name"]
    for o in of_kind(objs, *WORKLOADS):
        labels = pod_labels(o)
        assert selects(o["spec"]["selector"], labels) if "selector" in o["spec"] else True
        assert labels["app.kubernetes.io/name"] == "tandem" and labels["app.kubernetes.io/instance"]
        if role(o) in ROLES:
            assert labels["tandem/role"] == role(o)


def test_strict_validation_rejects_an_unknown_field(rendered):
    gateway = copy.deepcopy(next(o for o in tandem_workloads(rendered["cpu"]) if role(o) == "gateway"))
    pod_spec(gateway)["containers"][0]["livenessProbe"]["grpcc"] = {"port": 50051}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(gateway, K8S_VERSION, strict=True)


# ------------------------------------------------------------------------------- pods
@pytest.mark.parametrize("target", OVERLAYS + list(COMBOS))
def test_probes_on_every_container(rendered, target):
    for o in of_kind(rendered[target], "Deployment", "StatefulSet"):
        for c in pod_spec(o)["containers"]:
            name = f"{o['metadata']['name']}/{c['name']}"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in c, f"{name}: no {probe}"
                p = c[probe]
                if "grpc" in p:
                    assert p["grpc"]["port"] == ports_of(c)["grpc"], f"{name} {probe}"
                for kind in ("httpGet", "tcpSocket"):
                    if kind in p and isinstance(p[kind]["port"], str):
                        assert p[kind]["port"] in ports_of(c), f"{name} {probe}: no such port"
            if role(o) in ("prefill", "decode"):
                assert all("grpc" in c[p] for p in ("startupProbe", "readinessProbe", "livenessProbe"))
                start = c["startupProbe"]
                assert start["periodSeconds"] * start["failureThreshold"] >= 300  # model load
            if role(o) == "gateway":
                assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
                assert c["livenessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("target", TARGETS)
def test_resources_and_threads(rendered, target):
    for o in of_kind(rendered[target], *WORKLOADS):
        for c in pod_spec(o)["containers"]:
            res, name = c["resources"], f"{o['metadata']['name']}/{c['name']}"
            for r in ("cpu", "memory"):
                assert r in res["requests"] and r in res["limits"], f"{name}: no {r} request/limit"
            if role(o) in ROLES:
                threads = int(env_value(c, "TANDEM_NUM_THREADS"))
                assert res["requests"]["cpu"] == str(threads), f"{name}: CPU request != threads"
                assert env_value(c, "OMP_NUM_THREADS") == str(threads)
            if target.startswith("gpu") and role(o) in ("prefill", "decode"):
                assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"


def dockerfile_uid() -> int:
    return int(re.search(r"^ARG TANDEM_UID=(\d+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1))


@pytest.mark.parametrize("target", TARGETS)
def test_security_context_is_restricted(rendered, target):
    for o in of_kind(rendered[target], *WORKLOADS):
        spec, name = pod_spec(o), o["metadata"]["name"]
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, name
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec.get("automountServiceAccountToken") is False, name
        if spec["containers"][0]["image"].split(":")[0].endswith("tandem"):
            assert sc["runAsUser"] == dockerfile_uid(), f"{name}: uid differs from the Dockerfile's"
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False and not csc.get("privileged"), name
            assert csc["readOnlyRootFilesystem"] is True, name
            assert csc["capabilities"]["drop"] == ["ALL"], name
            allowed_add = {"IPC_LOCK"} if target.startswith("gpu") and role(o) in ("prefill", "decode") else set()
            assert set(csc["capabilities"].get("add", [])) <= allowed_add, name
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
            if role(o) in ROLES or o["kind"] == "Job":  # the Tandem image's writable dirs
                for path in ("/tmp", "/var/cache/tandem"):
                    assert "emptyDir" in mounts[path], f"{name}: {path} is not an emptyDir"
            if role(o) in ("prefill", "decode"):
                assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory", name


def test_image_cache_dirs_are_the_mounted_ones():
    text = (ROOT / "Dockerfile").read_text()
    for var in ("TANDEM_CACHE_DIR", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "MPLCONFIGDIR"):
        values = re.findall(rf"\b{var}=(\S+)", text)
        assert values and all(v.startswith("/var/cache/tandem") for v in values), var


@pytest.mark.parametrize("target", OVERLAYS)
def test_workers_advertise_pod_ip_and_grace_periods(rendered, target):
    graces = {}
    for o in tandem_workloads(rendered[target]):
        spec, c = pod_spec(o), pod_spec(o)["containers"][0]
        graces[role(o)] = spec["terminationGracePeriodSeconds"]
        assert config_of(rendered[target], o)["host"] == "0.0.0.0"
        sel = spec["topologySpreadConstraints"][0]["labelSelector"]
        assert selects(sel, pod_labels(o)), f"{o['metadata']['name']}: spread selector"
        if role(o) in ("prefill", "decode"):
            ref = env_of(c)["TANDEM_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert ref == "status.podIP"
        if role(o) == "gateway":
            assert c["lifecycle"]["preStop"]["sleep"]["seconds"] < graces["gateway"]
    assert graces["decode"] >= 90 and graces["prefill"] >= 30 and graces["gateway"] >= 30, graces


@pytest.mark.parametrize("target", TARGETS)
def test_env_references_resolve_to_earlier_variables(rendered, target):
    for o in of_kind(rendered[target], *WORKLOADS):
        for c in pod_spec(o)["containers"]:
            defined: list[str] = []
            for e in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                    assert ref in defined, f"{o['metadata']['name']}: {e['name']} uses $({ref}) before it is set"
                defined.append(e["name"])
            for ref in re.findall(r"\$\((\w+)\)", " ".join(c.get("args", []))):
                assert ref in defined, f"{o['metadata']['name']}: args use $({ref})"


@pytest.mark.parametrize("target", TARGETS)
def test_secrets_are_referenced_never_inlined(rendered, target):
    objs = rendered[target]
    assert not of_kind(objs, "Secret"), "a Secret is rendered from the repository"
    for o in of_kind(objs, *WORKLOADS):
        spec = pod_spec(o)
        for v in spec.get("volumes", []):
            if "secret" in v:
                assert v["secret"]["secretName"] == SECRET
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == SECRET
                elif re.search(r"PASSWORD|SECRET|TOKEN|API_KEY|AUTH", e["name"]) and not e["name"].endswith("_FILE"):
                    pytest.fail(f"{o['metadata']['name']}: {e['name']} is a literal, not a secretKeyRef")
                if "@" in e.get("value", ""):  # a URL with credentials
                    assert "$(REDIS_PASSWORD)" in e["value"], f"{e['name']} inlines a password"


# ------------------------------------------------------------------------------- wiring
def pods(objs: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, pod labels) of every long-running workload."""
    return [(o, pod_labels(o)) for o in of_kind(objs, "Deployment", "StatefulSet")]


def service_port(objs: list[dict], host: str, port: int) -> None:
    """Assert that ``host:port`` names a rendered Service port."""
    svc = [s for s in of_kind(objs, "Service") if s["metadata"]["name"] == host]
    assert svc, f"{host}: no such Service"
    assert port in [p["port"] for p in svc[0]["spec"]["ports"]], f"{host}:{port}: no such port"


@pytest.mark.parametrize("target", OVERLAYS + list(COMBOS))
def test_services_select_pods_whose_ports_agree_with_the_config(rendered, target):
    objs = rendered[target]
    for svc in of_kind(objs, "Service"):
        selected = [o for o, labels in pods(objs) if selects({"matchLabels": svc["spec"]["selector"]}, labels)]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for o in selected:
            c = pod_spec(o)["containers"][0]
            for p in svc["spec"]["ports"]:
                target_port = p["targetPort"]
                numbers = ports_of(c)
                assert (numbers.get(target_port) if isinstance(target_port, str) else target_port) \
                    == p["port"], f"{svc['metadata']['name']}:{p['name']} -> {o['metadata']['name']}"
    for o in tandem_workloads(objs):
        c, cfg = pod_spec(o)["containers"][0], config_of(objs, o)
        if role(o) == "gateway":
            assert ports_of(c) == {"grpc": cfg["gateway"]["port"],
                                   "http": int(env_value(c, "TANDEM_HTTP_PORT"))}
        else:
            assert ports_of(c) == {"grpc": cfg["worker"]["port"], "kv": cfg["worker"]["kv_port"],
                                   "metrics": int(env_value(c, "TANDEM_METRICS_PORT"))}
        url = env_of(c)["REDIS_URL"]
        if "value" in url:  # in-cluster Redis; otherwise a secretKeyRef (external-redis)
            host, port = re.fullmatch(r"redis://:\$\(REDIS_PASSWORD\)@([\w-]+):(\d+)/\d+", url["value"]).groups()
            service_port(objs, host, int(port))
        else:
            assert not of_kind(objs, "StatefulSet"), "external Redis but the StatefulSet is rendered"


def test_load_test_job_targets_the_gateway_service(rendered):
    (job,) = of_kind(rendered["loadtest"], "Job")
    args = pod_spec(job)["containers"][0]["args"]
    assert args[:2] == ["bench", "serve"] and pod_spec(job)["restartPolicy"] == "Never"
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)/v1", args[args.index("--target") + 1]).groups()
    service_port(rendered["cpu"], host, int(port))
    gateway = next(s for s in of_kind(rendered["cpu"], "Service") if s["metadata"]["name"] == host)
    assert next(p for p in gateway["spec"]["ports"] if p["port"] == int(port))["name"] == "http"
    assert job["spec"]["activeDeadlineSeconds"] > 0 and job["spec"]["backoffLimit"] == 0


def allowed_peers(policies: list[dict], labels: dict, port: int) -> list[dict]:
    """The ``from`` peers of every ingress rule that admits traffic to ``labels``'s pod on
    ``port``; a rule without ``from`` admits everyone (``{"anyone": True}``)."""
    peers = []
    for np in policies:
        if not selects(np["spec"]["podSelector"], labels):
            continue
        for rule in np["spec"].get("ingress", []):
            rule_ports = [p["port"] for p in rule.get("ports", [])]
            if rule_ports and port not in rule_ports:
                continue
            peers += rule.get("from", [{"anyone": True}])
    return peers


def probe_only_ports(objs: list[dict], workload: dict) -> set[str]:
    """Named container ports that no Service exposes and only probes use."""
    c = pod_spec(workload)["containers"][0]
    exposed = {p["targetPort"] for s in of_kind(objs, "Service")
               if selects({"matchLabels": s["spec"]["selector"]}, pod_labels(workload))
               for p in s["spec"]["ports"]}
    probed = {c[p][k]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
              for k in ("httpGet", "tcpSocket") if k in c.get(p, {})}
    return {n for n in ports_of(c) if n in probed and n not in exposed}


@pytest.mark.parametrize("target", ["production", "gpu+production+observability"])
def test_network_policies_expose_only_the_gateway(rendered, target):
    objs = rendered[target]
    policies = of_kind(objs, "NetworkPolicy")
    all_pods = pods(objs)
    for np in policies:
        assert any(selects(np["spec"]["podSelector"], labels) for _, labels in all_pods), \
            f"NetworkPolicy {np['metadata']['name']} selects no pod"
        for rule in np["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer:
                    assert any(selects(peer["podSelector"], labels) for _, labels in all_pods), \
                        f"NetworkPolicy {np['metadata']['name']}: a peer selector matches no pod"
    for o, labels in all_pods:
        assert any(selects(np["spec"]["podSelector"], labels) and not np["spec"].get("ingress")
                   for np in policies), f"{o['metadata']['name']}: no default-deny policy"
        for name, port in ports_of(pod_spec(o)["containers"][0]).items():
            peers = allowed_peers(policies, labels, port)
            if role(o) == "gateway":
                assert {"anyone": True} in peers, f"gateway port {name} is not reachable"
                continue
            if name == "metrics":
                continue  # Prometheus, from its own namespace
            if name in probe_only_ports(objs, o):
                continue  # the kubelet's probes; NetworkPolicy does not apply to them
            assert peers, f"{o['metadata']['name']}:{name} admits nobody"
            for peer in peers:
                assert set(peer) == {"podSelector"}, f"{o['metadata']['name']}:{name} open to {peer}"
                admitted = [w for w, lb in all_pods if selects(peer["podSelector"], lb)]
                assert admitted and all(role(w) in ROLES for w in admitted), \
                    f"{o['metadata']['name']}:{name} admits {[w['metadata']['name'] for w in admitted]}"
    gateway_labels = next(lb for o, lb in all_pods if role(o) == "gateway")
    decode = next(o for o, _ in all_pods if role(o) == "decode")
    grpc_peers = allowed_peers(policies, pod_labels(decode), ports_of(pod_spec(decode)["containers"][0])["grpc"])
    assert any(selects(p["podSelector"], gateway_labels) for p in grpc_peers), "gateway cannot reach decode"


# ------------------------------------------------------------------------------- overlays
def test_gpu_overlay_runs_workers_on_cuda_with_nixl(rendered):
    objs = rendered["gpu"]
    for o in tandem_workloads(objs):
        cfg, c = config_of(objs, o), pod_spec(o)["containers"][0]
        assert (cfg["engine"]["device"], cfg["engine"]["dtype"]) == ("cuda", "bfloat16")
        assert cfg["transport"]["kv_transport"] == "nixl"
        assert c["image"].endswith("-cuda")
        if role(o) != "gateway":
            assert "UCX_TLS" in env_of(c)
            assert any(t["key"] == "nvidia.com/gpu" for t in pod_spec(o)["tolerations"])
    cpu_cfg = config_of(rendered["cpu"], tandem_workloads(rendered["cpu"])[0])
    assert (cpu_cfg["engine"]["device"], cpu_cfg["transport"]["kv_transport"]) == ("cpu", "tcp")
    for key in ("host", "worker", "gateway"):  # same ports and listen address as the base
        assert cfg[key] == cpu_cfg[key]


def scale_target(objs: list[dict], ref: dict) -> dict:
    (target,) = [o for o in of_kind(objs, ref["kind"]) if o["metadata"]["name"] == ref["name"]]
    return target


@pytest.mark.parametrize("target", ["production", "gpu+production+observability"])
def test_production_budgets_and_autoscalers_target_the_pools(rendered, target):
    objs = rendered[target]
    budgeted = set()
    for pdb in of_kind(objs, "PodDisruptionBudget"):
        matched = [o for o in tandem_workloads(objs) if selects(pdb["spec"]["selector"], pod_labels(o))]
        assert len(matched) == 1, f"PDB {pdb['metadata']['name']} selects {len(matched)} pools"
        budgeted.add(role(matched[0]))
    assert budgeted == set(ROLES)
    (hpa,) = of_kind(objs, "HorizontalPodAutoscaler")
    gateway = scale_target(objs, hpa["spec"]["scaleTargetRef"])
    assert role(gateway) == "gateway" and hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert hpa["spec"]["minReplicas"] >= 2
    for o in tandem_workloads(objs):  # the autoscalers own it: `kubectl apply` must not reset it
        assert "replicas" not in o["spec"], f"{o['metadata']['name']}: replicas set beside an autoscaler"
    queries = {}
    for so in of_kind(objs, "ScaledObject"):
        pool = role(scale_target(objs, so["spec"]["scaleTargetRef"]))
        assert so["spec"]["minReplicaCount"] >= 1  # never to zero: a pool of none fails requests
        queries[pool] = [t["metadata"]["query"] for t in so["spec"]["triggers"]]
        assert all(f'role="{pool}"' in q for q in queries[pool])
    assert any("tandem:num_requests_waiting" in q for q in queries["prefill"])
    assert {m for q in queries["decode"] for m in re.findall(r"tandem:\w+", q)} == {
        "tandem:num_requests_waiting", "tandem:kv_cache_usage_perc"}


@pytest.mark.parametrize("target", ["observability", "gpu+production+observability"])
def test_observability_wiring(rendered, target):
    objs = rendered[target]
    for o in tandem_workloads(objs):
        c = pod_spec(o)["containers"][0]
        endpoint = env_value(c, "OTEL_EXPORTER_OTLP_ENDPOINT")
        host, port = re.fullmatch(r"http://([\w-]+):(\d+)", endpoint).groups()
        service_port(objs, host, int(port))
        ann = o["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/path"] == "/metrics"
        assert int(ann["prometheus.io/port"]) == ports_of(c)["http" if role(o) == "gateway" else "metrics"]
    (sm,) = of_kind(objs, "ServiceMonitor")
    scraped = [s for s in of_kind(objs, "Service") if selects(sm["spec"]["selector"], s["metadata"]["labels"])]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in scraped} == set(ROLES)
    names = {p["name"] for s in scraped for p in s["spec"]["ports"]}
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= names
    (dash,) = [cm for cm in of_kind(objs, "ConfigMap") if cm["metadata"]["labels"].get("grafana_dashboard") == "1"]
    dashboard = json.loads(next(iter(dash["data"].values())))
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in ("tandem:num_requests_waiting", "tandem:num_requests_running", "tandem:kv_cache_usage_perc",
                   "tandem:time_to_first_token_seconds_bucket", "tandem:inter_token_latency_seconds_bucket"):
        assert metric in exprs, metric
    collector_cfg = next(yaml.safe_load(cm["data"]["config.yaml"]) for cm in of_kind(objs, "ConfigMap")
                         if cm["metadata"]["name"].startswith("tandem-otel-collector-config"))
    grpc_endpoint = collector_cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    collector = next(o for o in of_kind(objs, "Deployment") if role(o) == "otel-collector")
    assert int(grpc_endpoint.rsplit(":", 1)[1]) == ports_of(pod_spec(collector)["containers"][0])["otlp-grpc"]


def pod_environ(container: dict, pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: downward-API fields and Secret keys
    replaced by stand-ins, ``$(VAR)`` references expanded."""
    fields = {"status.podIP": "10.1.2.3", "metadata.name": pod_name}
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = "stand-in-secret"
    return env


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_config_file_and_env_load_into_the_settings_tree(rendered, target, tmp_path):
    sources = pytest.importorskip("services.config.sources",
                                  reason="the pydantic-settings tree (issue 11) is not in this tree")
    objs = rendered[target]
    for o in tandem_workloads(objs):
        c = pod_spec(o)["containers"][0]
        path = tmp_path / f"{role(o)}.yaml"
        path.write_text(yaml.safe_dump(config_of(objs, o)))
        settings = sources.load_settings(config_file=path, environ=pod_environ(c, f"tandem-{role(o)}-0")).settings
        assert settings.host == "0.0.0.0"
        assert settings.worker.num_threads == int(c["resources"]["requests"]["cpu"])
        assert settings.state.redis_url.startswith("redis://:stand-in-secret@tandem-redis:6379/")
        if role(o) == "gateway":
            assert settings.gateway.port == ports_of(c)["grpc"]
        else:
            assert (settings.worker.port, settings.worker.kv_port) == (ports_of(c)["grpc"], ports_of(c)["kv"])
            assert settings.worker.advertise_host == "10.1.2.3"
            assert settings.worker.worker_id == f"tandem-{role(o)}-0"
            assert settings.transport.internal_secret_file == "/etc/tandem/secrets/internal-secret"
