"""Prometheus scrape configuration for a stack whose ``/metrics`` endpoints are known (what
``tandem up`` writes beside its settings, and what the integration tests hand a real Prometheus).
In Kubernetes, ``k8s/components/observability`` carries the equivalents (pod annotations, a
ServiceMonitor, a kubernetes_sd scrape job)."""
from __future__ import annotations

from pathlib import Path

import yaml


def scrape_config(targets: dict[str, str], interval_s: float = 15.0,
                  job: str = "tandem") -> dict:
    """A prometheus.yml document scraping ``targets`` (process name -> ``host:port`` of its
    ``/metrics``) every ``interval_s`` seconds; each target is labelled ``process`` with its
    name. Raises ValueError naming ``interval_s`` when it is not positive."""
    if interval_s <= 0:
        raise ValueError(f"interval_s: must be > 0, got {interval_s}")
    interval = f"{max(1, round(interval_s * 1000))}ms"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [{
            "job_name": job,
            "metrics_path": "/metrics",
            "static_configs": [{"targets": [address], "labels": {"process": name}}
                               for name, address in sorted(targets.items())],
        }],
    }


def write_scrape_config(path: str | Path, targets: dict[str, str],
                        interval_s: float = 15.0) -> Path:
    """Write ``scrape_config(targets, interval_s)`` as YAML to ``path``; returns the path."""
    path = Path(path)
    path.write_text(yaml.safe_dump(scrape_config(targets, interval_s), sort_keys=False))
    return path
