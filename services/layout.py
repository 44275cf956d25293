"""Which workers `tandem up` starts on this machine, and how many torch threads each gets.

Rule of ``layout: auto`` (issue 15): on a machine with at most ``auto_unified_max_cores`` usable
cores, one unified worker with every core; on a larger one, one prefill and one decode worker
sharing the cores. Why: a worker computes on its own threads only, so a disaggregated pair on
few cores leaves the prefill worker's cores idle whenever no prompt is waiting (most of a chat
load's time: decode steps dominate), while one engine that prefills and decodes puts every core
on whatever work is waiting (chunked prefill beside the running batch's decode rows, vLLM v1 /
Sarathi-Serve). Disaggregation pays once each phase has cores of its own to spare: prefill
bursts then no longer stall the running streams' inter-token latency (DistServe section 2).
The crossing point depends on the CPU and the model: ``scripts/bench_layout.py`` measures the
options on one machine, and ``up.auto_unified_max_cores`` moves the threshold.

Explicit settings win over the rule: ``--layout``, ``--unified``, or worker counts
(``--num-unified`` implies unified, ``--num-prefill`` / ``--num-decode`` disaggregated), and an
explicit ``worker.num_threads`` is every worker's thread count.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from services.settings import Layout, UpSection


@dataclass(frozen=True)
class WorkerLayout:
    """Worker processes per role and torch threads per worker of each role."""

    num_prefill: int
    num_decode: int
    num_unified: int
    threads: dict[str, int]  # role -> torch threads of each of its workers
    reason: str  # why this layout: logged at start

    def describe(self) -> str:
        parts = [f"{n} {role} ({self.threads[role]} thread{'s' * (self.threads[role] > 1)} each)"
                 for role, n in (("prefill", self.num_prefill), ("decode", self.num_decode),
                                 ("unified", self.num_unified)) if n]
        return ", ".join(parts)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask: what a container or taskset
    grants, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def choose_layout(up: UpSection, cores: int, num_threads: int | None = None) -> WorkerLayout:
    """The layout for ``cores`` usable cores. ``num_threads``: threads per worker when the user
    set them, else None (the cores are shared among the workers, at least one each).

    Raises ValueError naming the setting when counts contradict the layout (``up.num_unified``
    with a disaggregated layout, ``up.num_prefill`` / ``up.num_decode`` with a unified one)."""
    if cores < 1:
        raise ValueError(f"cores: must be >= 1, got {cores}")
    layout, reason = _resolve(up, cores)
    if layout == Layout.unified:
        for name in ("num_prefill", "num_decode"):
            if getattr(up, name) is not None:
                raise ValueError(f"up.{name}: a unified layout has no {name[4:]} workers "
                                 f"(layout {layout.value}: {reason})")
        n = up.num_unified or 1
        return WorkerLayout(0, 0, n, {"unified": num_threads or max(1, cores // n)}, reason)
    if up.num_unified is not None:
        raise ValueError(f"up.num_unified: a disaggregated layout has no unified workers "
                         f"(layout {layout.value}: {reason})")
    p, d = up.num_prefill or 1, up.num_decode or 1
    share = num_threads or max(1, cores // (p + d))
    return WorkerLayout(p, d, 0, {"prefill": share, "decode": share}, reason)


def _resolve(up: UpSection, cores: int) -> tuple[Layout, str]:
    if up.layout != Layout.auto:
        return up.layout, "up.layout"
    if up.num_unified is not None and up.num_prefill is None and up.num_decode is None:
        return Layout.unified, "up.num_unified given"
    if up.num_prefill is not None or up.num_decode is not None:
        return Layout.disaggregated, "worker counts given"
    if cores <= up.auto_unified_max_cores:
        return Layout.unified, (f"auto: {cores} usable cores <= up.auto_unified_max_cores "
                                f"({up.auto_unified_max_cores})")
    return Layout.disaggregated, (f"auto: {cores} usable cores > up.auto_unified_max_cores "
                                  f"({up.auto_unified_max_cores})")
