"""The CPU a process may use: its affinity mask (what ``taskset`` or a container's cpuset
grants) and its cgroup's CPU quota (what a Kubernetes CPU limit becomes: a CFS quota of
``quota / period`` CPUs). Threads beyond that budget do not run in parallel; in an OpenMP team
they stall every join while a member waits for the CPU, so a worker sizes its team from this,
never from ``os.cpu_count()``.

Linux cgroup v2: ``cpu.max`` (``"max 100000"`` or ``"200000 100000"``); v1: ``cpu.cfs_quota_us``
(``-1``: none) and ``cpu.cfs_period_us``. The effective quota is the smallest along the path
from the process's cgroup (``/proc/self/cgroup``) up to the hierarchy's mount point.
"""
from __future__ import annotations

import math
import os
from pathlib import Path


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def cgroup_cpu_quota(root: Path | str = "/sys/fs/cgroup",
                     proc_cgroup: Path | str = "/proc/self/cgroup") -> float | None:
    """This process's CPU quota in CPUs (fractional: 1.5 for ``150000 100000``), or None when
    no cgroup along its path sets one (or the files cannot be read). ``root``: where the
    hierarchies are mounted (v2 there or, on a hybrid host, at ``unified/``; v1 at ``cpu/`` or
    ``cpu,cpuacct/``)."""
    root = Path(root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:  # v2: the unified hierarchy
            hybrid = not (root / "cgroup.controllers").exists() and (root / "unified").is_dir()
            mount, read = (root / "unified" if hybrid else root), _v2_quota
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy
            mount = next((m for m in (root / controllers, root / "cpu") if m.is_dir()), root / "cpu")
            read = _v1_quota
        else:
            continue
        directory = mount / path.lstrip("/")
        while True:  # the process's cgroup and each parent up to the mount point
            quota = read(directory)
            if quota is not None:
                found.append(quota)
            if directory == mount or mount not in directory.parents:
                break
            directory = directory.parent
    return min(found) if found else None


def available_cpus(root: Path | str = "/sys/fs/cgroup", proc_cgroup: Path | str = "/proc/self/cgroup",
                   affinity: int | None = None) -> int:
    """Whole CPUs this process can keep busy: its affinity (or ``affinity``), capped by its
    cgroup quota rounded up (a quota of 1.5 CPUs still runs 2 threads at once, for part of each
    period); at least 1."""
    cpus = affinity_cpus() if affinity is None else affinity
    quota = cgroup_cpu_quota(root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota - 1e-9))
    return max(1, cpus)
