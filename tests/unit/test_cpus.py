"""The CPU budget a worker sizes its threads from (services/engine/cpus.py): affinity capped by
the cgroup CPU quota, v1 and v2, nested cgroups, hybrid hosts; and a real cgroup where this
machine lets the test make one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.cpus import available_cpus, cgroup_cpu_quota


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_quota_is_the_smallest_along_the_path(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpu memory")
    write(root / "cpu.max", "max 100000")
    write(root / "kubepods" / "cpu.max", "400000 100000")
    write(root / "kubepods" / "pod1" / "cpu.max", "150000 100000")
    write(root / "kubepods" / "pod1" / "c1" / "cpu.max", "max 100000")
    proc = tmp_path / "proc-cgroup"
    write(proc, "0::/kubepods/pod1/c1\n")
    assert cgroup_cpu_quota(root, proc) == 1.5
    assert available_cpus(root, proc, affinity=8) == 2  # 1.5 CPUs: two threads run at once
    write(root / "kubepods" / "pod1" / "cpu.max", "50000 100000")
    assert available_cpus(root, proc, affinity=8) == 1
    assert available_cpus(root, proc, affinity=1) == 1


def test_v1_quota_and_no_quota(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "200000\n")
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    proc = tmp_path / "proc-cgroup"
    write(proc, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    assert cgroup_cpu_quota(root, proc) == 2.0
    assert available_cpus(root, proc, affinity=16) == 2
    write(proc, "3:cpu,cpuacct:/\n")
    assert cgroup_cpu_quota(root, proc) is None
    assert available_cpus(root, proc, affinity=16) == 16


def test_hybrid_host_reads_the_unified_mount_and_unreadable_files_mean_no_quota(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "unified" / "svc" / "cpu.max", "300000 100000")
    proc = tmp_path / "proc-cgroup"
    write(proc, "1:name=systemd:/svc\n0::/svc\n")
    assert cgroup_cpu_quota(root, proc) == 3.0
    assert cgroup_cpu_quota(root, tmp_path / "missing") is None
    write(root / "unified" / "svc" / "cpu.max", "garbage")
    assert cgroup_cpu_quota(root, proc) is None


def _cgroup_v1_cpu() -> Path | None:
    mount = Path("/sys/fs/cgroup/cpu")
    if not (mount / "cpu.cfs_quota_us").exists() or not os.access(mount, os.W_OK):
        return None
    return mount


@pytest.mark.skipif(_cgroup_v1_cpu() is None, reason="no writable cgroup v1 cpu hierarchy here")
def test_a_real_cgroup_quota_is_seen_by_a_process_inside_it():
    group = _cgroup_v1_cpu() / f"tandem-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("50000")
        code = ("import os, sys; open(sys.argv[1], 'w').write(str(os.getpid())); "
                "from services.engine.cpus import available_cpus, cgroup_cpu_quota; "
                "print(cgroup_cpu_quota(), available_cpus())")
        # the child joins the group before it reads its budget: `sh` writes its own pid
        out = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1" /dev/null',
                              sys.executable, code], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).parents[2])
        assert out.stdout.split() == ["0.5", "1"], out
    finally:
        group.rmdir()
