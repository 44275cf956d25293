"""k8s/ and the drain deadlines agree (services/runtime/drain.py): every role's pod, with the config file
and environment it gets, finishes its drain before Kubernetes' SIGKILL at the end of
``terminationGracePeriodSeconds``.

- a worker exits by its role's drain deadline + ``worker.kv_lease_s`` (quarantined KV blocks)
  + the process's own stop;
- a gateway by its preStop sleep + ``gateway.drain_s`` + its stop.
"""
from __future__ import annotations

import pytest
import yaml

from services.config.sources import load_settings
from tests.unit.test_k8s_manifests import (  # noqa: F401  (rendered: the shared fixture)
    OVERLAYS, config_of, pod_environ, pod_spec, rendered, role, tandem_workloads)

STOP_S = 5  # gRPC server stop and process exit after the drain, seconds


def drain_bound_s(o: dict, settings) -> float:
    """Seconds from SIGTERM until the pod's process has exited, at most."""
    if role(o) == "gateway":
        pre_stop = pod_spec(o)["containers"][0].get("lifecycle", {}).get("preStop", {})
        return pre_stop.get("sleep", {}).get("seconds", 0) + settings.gateway.drain_s + STOP_S
    w = settings.worker
    drain = w.decode_drain_s if role(o) == "decode" else w.prefill_drain_s
    return drain + w.kv_lease_s + STOP_S


@pytest.mark.parametrize("target", OVERLAYS)
def test_drain_ends_before_the_grace_period(rendered, target, tmp_path):
    objs = rendered[target]
    seen = set()
    for o in tandem_workloads(objs):
        c = pod_spec(o)["containers"][0]
        path = tmp_path / f"{role(o)}.yaml"
        path.write_text(yaml.safe_dump(config_of(objs, o)))
        settings = load_settings(config_file=path, environ=pod_environ(c, f"{role(o)}-0")).settings
        grace = pod_spec(o)["terminationGracePeriodSeconds"]
        assert drain_bound_s(o, settings) <= grace, (
            f"{target}: {o['metadata']['name']} drains for up to {drain_bound_s(o, settings)}s, "
            f"past its terminationGracePeriodSeconds {grace}")
        seen.add(role(o))
    assert seen == {"gateway", "prefill", "decode"}, seen


def test_a_long_drain_is_caught(rendered, tmp_path):
    """The check above can fail: a decode drain as long as the grace period does."""
    objs = rendered["cpu"]
    [decode] = [o for o in tandem_workloads(objs) if role(o) == "decode"]
    config = config_of(objs, decode)
    config["worker"]["decode_drain_s"] = pod_spec(decode)["terminationGracePeriodSeconds"]
    path = tmp_path / "decode.yaml"
    path.write_text(yaml.safe_dump(config))
    settings = load_settings(config_file=path, environ={}).settings
    assert drain_bound_s(decode, settings) > pod_spec(decode)["terminationGracePeriodSeconds"]
