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

On GPUs (``engine.device`` cuda) the rule counts GPUs instead of cores. One GPU: a prefill and
a decode worker share it (KV handoff by CUDA IPC, well under a millisecond for a 2k-token
prompt). Measured on an H100 (``scripts/gpu_checks.sh stack``, docs/benchmarks.md): under load
the pair serves more and steadier tokens than one unified worker, 1.36x at 16 clients on
512-token prompts and 1.9x on 4k-token ones, with half the TPOT, because the decode worker's
steps stay pure decode, which replay as CUDA graphs, while a unified worker's steps that carry
a prompt chunk ran eager then (since 58212c4 they replay in pieces, and prefill steps from
graphs of their own: not yet measured against the pair); one client alone is served at the
same speed either way (unified's TTFT is 10-17 ms lower). Several GPUs: one unified worker
each (not yet measured against pairs). Asked for another layout, the workers are placed on the
GPUs round-robin in start order (unified, decode, prefill); workers that share a GPU share its
``engine.gpu_memory_utilization`` equally (``gpu_placement``).

Explicit settings win over the rule: ``--layout``, ``--unified``, or worker counts
(``--num-unified`` implies unified, ``--num-prefill`` / ``--num-decode`` disaggregated), and an
explicit ``worker.num_threads`` is every worker's thread count.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from services.engine.cpus import available_cpus
from services.config.settings import Layout, UpSection


@dataclass(frozen=True)
class WorkerLayout:
    """Worker processes per role and torch threads per worker of each role."""

    num_prefill: int
    num_decode: int
    num_unified: int
    threads: dict[str, int]  # role -> torch threads of each of its workers
    reason: str  # why this layout: logged at start
    gpus: tuple[str, ...] = ()  # GPU ids the workers are placed on (gpu_placement); () on CPU
    num_gateways: int = 1  # gateway processes on the gateway's ports (auto_gateways)

    def worker_ids(self) -> list[tuple[str, str]]:
        """(role, worker id) of every worker, in start order."""
        return [(role, f"{role}-{i}") for role, n in (
            ("unified", self.num_unified), ("decode", self.num_decode),
            ("prefill", self.num_prefill)) for i in range(n)]

    def describe(self) -> str:
        parts = [f"{n} {role} ({self.threads[role]} thread{'s' * (self.threads[role] > 1)} each)"
                 for role, n in (("prefill", self.num_prefill), ("decode", self.num_decode),
                                 ("unified", self.num_unified)) if n]
        return (", ".join(parts) + (f" on GPUs {','.join(self.gpus)}" if self.gpus else "")
                + (f", {self.num_gateways} gateways" if self.num_gateways > 1 else ""))


def usable_cores() -> int:
    """CPU cores this process may keep busy: its affinity mask (what a container or taskset
    grants, not the machine's total) capped by its cgroup CPU quota (``engine.cpus``)."""
    return available_cpus()


def visible_gpus(env: dict[str, str] | None = None) -> list[str]:
    """Ids of the GPUs this process may use, found without initialising CUDA:
    ``CUDA_VISIBLE_DEVICES`` when set (its entries up to the first empty or negative one, as
    the CUDA runtime reads it), else one per entry of the NVIDIA driver's
    ``/proc/driver/nvidia/gpus``, else none."""
    env = os.environ if env is None else env
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = []
        for entry in (e.strip() for e in listed.split(",")):
            if not entry or entry.startswith("-"):
                break
            ids.append(entry)
        return ids
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def gpu_placement(layout: WorkerLayout, utilization: float) -> dict[str, tuple[str, float]]:
    """Worker id -> (GPU id, its share of ``utilization``): round-robin over ``layout.gpus`` in
    start order; the workers on one GPU split ``utilization`` equally. Empty without GPUs."""
    if not layout.gpus:
        return {}
    ids = [worker_id for _, worker_id in layout.worker_ids()]
    on = [layout.gpus[k % len(layout.gpus)] for k in range(len(ids))]
    return {w: (gpu, utilization / on.count(gpu)) for w, gpu in zip(ids, on)}


def auto_gateways(cores: int, gpus: int) -> int:
    """Gateway processes when ``up.num_gateways`` is not set: 1 on CPUs, where the model is
    the bound and more gateways take its cores (a single stream was 8-12% slower with four on
    2 cores); on GPUs one per 4 usable cores, at most 4. One gateway relays ~4,000-6,500
    tokens/s, a fraction of a GPU decode worker's; on an H200 with 16 host cores, one unified
    worker behind four made 1.19x / 1.45x the tokens/s of one at 16 / 64 clients (0.94x /
    1.89x in the session before), and 0.86x / 1.01x of the in-process engine against one's
    0.65x / 0.54x (docs/benchmarks.md, GPU)."""
    return min(4, max(1, cores // 4)) if gpus else 1


def choose_layout(up: UpSection, cores: int, num_threads: int | None = None,
                  gpus: list[str] | None = None, shared_port: bool = True) -> WorkerLayout:
    """The layout for ``cores`` usable cores and, when the workers run on GPUs, the ``gpus``
    they may use (ids; ``visible_gpus``). ``num_threads``: threads per worker when the user set
    them, else None (the cores are shared among the workers, at least one each).
    ``shared_port``: the gateway's port is fixed, so gateways can share it; a drawn one (0)
    keeps one gateway unless ``up.num_gateways`` asks for more (``UpOptions`` refuses that).

    Raises ValueError naming the setting when counts contradict the layout (``up.num_unified``
    with a disaggregated layout, ``up.num_prefill`` / ``up.num_decode`` with a unified one), or
    ``engine.device`` when the workers are for GPUs and none is visible."""
    if cores < 1:
        raise ValueError(f"cores: must be >= 1, got {cores}")
    if gpus is not None and not gpus:
        raise ValueError("engine.device: cuda, but no GPU is visible (CUDA_VISIBLE_DEVICES, "
                         "/proc/driver/nvidia/gpus)")
    placed = tuple(gpus or ())
    layout, reason = _resolve(up, cores, len(placed))
    gateways = up.num_gateways or (auto_gateways(cores, len(placed)) if shared_port else 1)
    if layout == Layout.unified:
        for name in ("num_prefill", "num_decode"):
            if getattr(up, name) is not None:
                raise ValueError(f"up.{name}: a unified layout has no {name[4:]} workers "
                                 f"(layout {layout.value}: {reason})")
        n = up.num_unified or max(1, len(placed))
        return WorkerLayout(0, 0, n, {"unified": num_threads or max(1, cores // n)}, reason,
                            placed, gateways)
    if up.num_unified is not None:
        raise ValueError(f"up.num_unified: a disaggregated layout has no unified workers "
                         f"(layout {layout.value}: {reason})")
    p, d = up.num_prefill or 1, up.num_decode or 1
    share = num_threads or max(1, cores // (p + d))
    return WorkerLayout(p, d, 0, {"prefill": share, "decode": share}, reason, placed, gateways)


def _resolve(up: UpSection, cores: int, gpus: int) -> tuple[Layout, str]:
    if up.layout != Layout.auto:
        return up.layout, "up.layout"
    if up.num_unified is not None and up.num_prefill is None and up.num_decode is None:
        return Layout.unified, "up.num_unified given"
    if up.num_prefill is not None or up.num_decode is not None:
        return Layout.disaggregated, "worker counts given"
    if gpus == 1:
        return Layout.disaggregated, ("auto: 1 GPU, shared by a prefill and a decode worker "
                                      "(faster under load than one unified worker)")
    if gpus:
        return Layout.unified, f"auto: {gpus} GPUs, one unified worker each"
    if cores <= up.auto_unified_max_cores:
        return Layout.unified, (f"auto: {cores} usable cores <= up.auto_unified_max_cores "
                                f"({up.auto_unified_max_cores})")
    return Layout.disaggregated, (f"auto: {cores} usable cores > up.auto_unified_max_cores "
                                  f"({up.auto_unified_max_cores})")
