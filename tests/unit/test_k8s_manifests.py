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
CRDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "ServiceMonitor")}
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
            assert o["spec"], f"{o['kind']} {o['metadata']['name']}: empty spec"
            continue
        validate_strict(o)
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == "tandem", f"{o['kind']} {o['metadata']['name']}"


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
