"""CPU cost and op count of one decode step, in process (``python -m scripts.profile_decode_step``).

The engine on the built-in GGUF (or ``--model``: a checkpoint directory, e.g. random weights of
the same shape on a GPU machine without the GGUF; ``--dtype``/``--quantization``, default ``auto``/``auto``: the
served default; ``--device cuda`` for a GPU), per batch size (default 1, 16, 64): ``batch``
requests of ``--prompt-len`` (default 16) random prompt tokens are prefilled, ``--warmup`` decode steps run, then
``--steps`` decode steps are timed in CPU seconds of this process (``time.process_time``: every
thread's CPU time, steady on a loaded machine; wall time is printed beside it), and
``--profile-steps`` more run under ``torch.profiler``: aten ops per step (all, and those that
are not views, which is what launches a kernel on a GPU), the top ops by self CPU time, and on
CUDA the kernel launches, host synchronisations and queued (``cudaMemcpyAsync``) copies per step,
the device's busy time per step (kernels and copies) and its share of the wall time, the
host's time waiting in those synchronisations (``host_wait_ms_per_step``: the CUDA calls' own
wall time under the profiler) and the host's own work (``host_busy_ms_per_step``: the CPU time
less the waits that spin, which must stay under the device's busy time for the GPU to bound a
step), the kernels that take most of the device's time, the CUDA runtime and driver calls that take
most of the host's (``top_api_calls``: graph and kernel launches, copies, events, pinned
allocations, each call's wall time under the profiler), and
where each synchronisation is made (``sync_sites``: torch's sync debug mode, over
``--profile-steps`` more steps).
After warm-up the start-up heap is frozen out of garbage collection, as a served worker's is
(``services/startup_heap.py``): otherwise a full collection of its ~210,000 objects falls among
the timed steps now and then, which no server pays.
``graph_launch_ms``: the host's time in one launch of the batch's decode graph, the device idle
(``graph_launch_ms``'s docstring). ``host_reads_per_step`` counts the runner's device-to-host
copies of sampled tokens. Also the
CPU split of a step's phases (schedule, prepare_inputs, forward, sample, postprocess) and the
rest of ``engine.step``.

``--sampling greedy`` (default) runs greedy requests; ``mixed`` cycles through four kinds in
every batch: greedy, seeded temperature + top-k + top-p, penalties + min_tokens, greedy with 5
logprobs, so every sampler path is in every step: the op count must not grow with the batch;
``chat`` gives every row what chat clients usually send (seeded temperature 0.7 + top-p 0.9):
on a CPU the C sampler's cost, on a GPU the torch sampler's launches beside the decode graph.

``--host-only``: the engine's own work per step, without the model. Its forward and LM head
are replaced by constant hidden states and a 16-token head (every row samples token 5;
greedy only), decode steps go through the CUDA-graph runner's buffers (on a CPU run eagerly,
``capture=False``) and async scheduling is on as on a GPU (``--no-async-scheduling`` turns it
off): what is left is what the host does per step on a GPU with graphs (scheduling, the
persistent batch, staging the inputs, sampling calls, updating requests, metrics), minus the
CUDA calls' own cost. The device's time per step must exceed this for a step to cost only
the GPU's time.

The wait for a launched step's tokens sleeps (a blocking event,
``model_runner.copy_done_event``), so it costs no CPU time; ``--spin-wait`` makes it spin
as it did before (CUDA's default event), to compare the two in one run. The other
synchronisations (a synchronous step's ``tolist``, ``cudaMemcpy``) spin as CUDA's default
schedule has them, and their time is counted as waiting, not work.

Prints a table and writes JSON (``--out``). Compare figures only within one run and one thread
count (``--threads``; with 2, OpenMP's waiting threads count as CPU time too).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch


# ops that only make a view of their input: no kernel runs for them on a GPU
VIEW_OPS = frozenset(f"aten::{op}" for op in (
    "view", "_unsafe_view", "reshape", "as_strided", "slice", "select", "t", "transpose",
    "unsqueeze", "squeeze", "expand", "permute", "alias", "detach", "detach_", "lift_fresh",
    "split", "split_with_sizes", "chunk", "unbind", "narrow", "flatten", "view_as", "numpy_T",
    "resolve_conj", "resolve_neg", "empty", "empty_like", "empty_strided", "to", "contiguous",
    "result_type", "item", "_local_scalar_dense"))
# CUDA runtime / driver calls, matched by exact name: "cudaMemcpy" is the synchronous copy, and
# a prefix match would also count every cudaMemcpyAsync (which is how 3 / 11 / 11 "syncs" per
# step were reported on an H100 for steps that wait on the device once)
LAUNCH_EVENTS = frozenset(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                           "cuLaunchKernelEx"))
SYNC_EVENTS = frozenset(("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                         "cudaMemcpy"))
COPY_EVENTS = frozenset(("cudaMemcpyAsync",))  # host <-> device and device copies, queued
# the syncs whose wait is CPU time: all but the wait on the engine's blocking copy event
SPINNING_SYNC_EVENTS = SYNC_EVENTS - {"cudaEventSynchronize"}


def device_events(events) -> list:
    """The kernels and copies among profiler ``events``, most device time first (each event's
    own device time; kernels replayed from a CUDA graph are recorded one by one)."""
    return sorted((a for a in events if a.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda a: a.self_device_time_total, reverse=True)


def api_calls(events) -> list:
    """The CUDA runtime and driver calls among profiler ``events`` (host-side events named
    ``cuda*``/``cu*``: graph launches, kernel launches, copies, event records and queries,
    pinned allocations), most CPU time first: what the host's CUDA work per step is made of."""
    return sorted((a for a in events if a.device_type == torch.autograd.DeviceType.CPU
                   and a.key.startswith("cu")), key=lambda a: a.cpu_time_total, reverse=True)


def count_calls(events, names: frozenset[str]) -> int:
    """Calls of the functions ``names`` among profiler ``events`` (``key``, ``count``)."""
    return sum(a.count for a in events if a.key in names)


def calls_ms(events, names: frozenset[str]) -> float:
    """CPU milliseconds spent inside the functions ``names`` among profiler ``events``
    (``key``, ``cpu_time_total`` in microseconds)."""
    return sum(a.cpu_time_total for a in events if a.key in names) / 1e3


def make_engine(dtype: str, quantization: str, max_batch: int, device: str = "cpu",
                enforce_eager: bool = False, async_scheduling: bool | None = None,
                kv_cache_dtype: str = "auto", max_context: int = 0, model: str | None = None):
    from services.engine.engine import EngineConfig, LLMEngine
    from services.startup_heap import freeze_startup_heap

    blocks = max(2048, max_batch * (max_context // 16 + 2))  # max_context: prompt + steps
    e = LLMEngine(EngineConfig(**({"model": model} if model else {}), dtype=dtype,
                               quantization=quantization, num_kv_blocks=blocks,
                               max_num_seqs=max(64, max_batch), device=device,
                               enforce_eager=enforce_eager, async_scheduling=async_scheduling,
                               kv_cache_dtype=kv_cache_dtype))
    e.warm_up()
    freeze_startup_heap("profile_decode_step")  # as a served worker does (services/runtime/serve.py)
    return e


class ConstantModel:
    """``--host-only``'s model: hidden states of zeros and a 16-token head whose bias makes
    token 5 every row's argmax (no model work, the same interface)."""

    HEAD = 16

    def __init__(self, config, max_tokens: int, device) -> None:
        self.config = dataclasses.replace(config, vocab_size=self.HEAD)
        self.hidden = torch.zeros(max_tokens, config.hidden_size, device=device)
        self.bias = torch.zeros(self.HEAD, device=device)
        self.bias[5] = 1.0

    def __call__(self, input_ids, positions, kv_cache, attn):
        return self.hidden[:input_ids.shape[0]]

    def compute_logits(self, hidden, out=None):
        logits = self.bias.expand(hidden.shape[0], self.HEAD)
        return logits if out is None else out.copy_(logits)


def host_only(e) -> None:
    """Swap ``e``'s model for ``ConstantModel``, through CUDA-graph buffers (``--host-only``)."""
    from services.engine.cuda_graphs import CUDAGraphRunner

    runner = e.runner
    runner.model = ConstantModel(e.model_config, e.config.max_num_batched_tokens, runner.device)
    runner.graphs = CUDAGraphRunner(runner.model, runner.kv_cache, e.config.max_num_seqs,
                                    e.block_manager.blocks_needed(e.max_model_len), capture=False)


def sampling_params(kind: str, i: int, tokens: int):
    """The i-th request's settings for ``--sampling kind`` (see the module docstring)."""
    from services.engine.sampling_params import SamplingParams

    base = {"max_tokens": tokens, "ignore_eos": True}
    if kind == "chat":
        return SamplingParams(temperature=0.7, top_p=0.9, seed=i, **base)
    if kind == "greedy" or i % 4 == 0:
        return SamplingParams(temperature=0, **base)
    return [None, SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i, **base),
            SamplingParams(temperature=0.7, frequency_penalty=0.5, repetition_penalty=1.2,
                           min_tokens=tokens, seed=i, **base),
            SamplingParams(temperature=0, logprobs=5, **base)][i % 4]


def _start(e, batch: int, tokens: int, seed: int, kind: str = "greedy",
           prompt_len: int = 16) -> None:
    """Add ``batch`` requests of ``prompt_len`` random prompt tokens and step until every one
    has its first token: what follows is decode."""
    import random

    rng = random.Random(seed)
    for i in range(batch):
        ids = [rng.randrange(17, e.model_config.vocab_size) for _ in range(prompt_len)]
        e.add_request(e.make_request(f"p{seed}-{i}", ids, sampling_params(kind, i, tokens)))
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in e.step())


class PhaseClock:
    """``timed`` for ``ModelRunner.execute``: CPU seconds per phase (process_time)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)

    def __call__(self, phase: str, fn, *args):
        t0 = time.process_time()
        try:
            return fn(*args)
        finally:
            self.cpu[phase] += time.process_time() - t0


def profile_batch(e, batch: int, warmup: int, steps: int, profile_steps: int, top: int,
                  seed: int, sampling: str = "greedy", prompt_len: int = 16,
                  spin_wait: bool = False) -> dict:
    """Decode-step figures at ``batch`` running sequences (see the module docstring).
    ``spin_wait``: the engine's copy events spin (``--spin-wait``), so their waits are CPU
    time too."""
    from torch.profiler import ProfilerActivity, profile

    cuda = e.runner.device.type == "cuda"
    _start(e, batch, warmup + steps + profile_steps + 4, seed, sampling, prompt_len)
    for _ in range(warmup):
        e.step()
    clock = PhaseClock()
    timed = e.metrics.timed  # every phase of a step goes through it
    e.metrics.timed = lambda phase, fn, *args: clock(phase, timed, phase, fn, *args)
    try:
        t0, w0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            e.step()
        cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    finally:
        del e.metrics.timed
    everything, reads0 = [], e.runner.num_host_reads
    if profile_steps:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(profile_steps):
                e.step()
        everything = list(prof.key_averages())
    host_reads = e.runner.num_host_reads - reads0
    sites = sync_sites(e, profile_steps) if cuda else {}
    launch_ms = graph_launch_ms(e, batch) if cuda else None
    while e.has_work():  # the batch finishes in a few steps: the next starts from empty
        e.step()
    kernels = device_events(everything) if cuda else []
    events = [a for a in everything if a.key.startswith("aten::")]
    ops = sum(a.count for a in events)
    compute_ops = sum(a.count for a in events if a.key not in VIEW_OPS)
    profile_steps = max(profile_steps, 1)
    events.sort(key=lambda a: a.self_cpu_time_total, reverse=True)
    phases = {k: v / steps * 1e3 for k, v in clock.cpu.items()}
    phases["engine_rest"] = cpu / steps * 1e3 - sum(phases.values())
    return {
        "batch": batch,
        "cpu_ms_per_step": cpu / steps * 1e3,
        "wall_ms_per_step": wall / steps * 1e3,
        "phase_cpu_ms_per_step": phases,
        "aten_ops_per_step": ops / profile_steps,
        "compute_ops_per_step": compute_ops / profile_steps,
        "host_reads_per_step": host_reads / profile_steps,
        **({"graph_launch_ms": launch_ms,
            "kernel_launches_per_step": count_calls(everything, LAUNCH_EVENTS) / profile_steps,
            "host_syncs_per_step": count_calls(everything, SYNC_EVENTS) / profile_steps,
            "async_copies_per_step": count_calls(everything, COPY_EVENTS) / profile_steps,
            "gpu_ms_per_step": (gpu := sum(a.self_device_time_total for a in kernels) / 1e3
                                / profile_steps),
            "gpu_busy_share": gpu / (wall / steps * 1e3),
            "host_wait_ms_per_step": calls_ms(everything, SYNC_EVENTS) / profile_steps,
            "host_busy_ms_per_step": cpu / steps * 1e3 - calls_ms(
                everything, SYNC_EVENTS if spin_wait else SPINNING_SYNC_EVENTS) / profile_steps,
            "sync_sites_per_step": {k: v / profile_steps for k, v in sites.items()},
            "top_kernels": [{"kernel": a.key, "calls_per_step": a.count / profile_steps,
                             "device_us_per_step": a.self_device_time_total / profile_steps}
                            for a in kernels[:top]],
            "top_api_calls": [{"call": a.key, "calls_per_step": a.count / profile_steps,
                               "cpu_us_per_step": a.cpu_time_total / profile_steps}
                              for a in api_calls(everything)[:top]]}
           if cuda else {}),
        "top_ops": [{"op": a.key, "calls_per_step": a.count / profile_steps,
                     "self_cpu_ms_per_step": a.self_cpu_time_total / profile_steps / 1e3}
                    for a in events[:top]],
    }


def graph_launch_ms(e, batch: int, reps: int = 21) -> float | None:
    """Host milliseconds of one ``cudaGraphLaunch`` of the decode graph that holds ``batch``
    (``torch.cuda.CUDAGraph.replay``'s wall time with the device idle before each, median of
    ``reps``), without the profiler (CUPTI records every node of a graph it launches). The
    replays rerun the last step staged in the graph's buffers: they write the same K/V into
    the same slots. None without graphs (eager)."""
    from services.engine.cuda_graphs import DECODE

    graphs = e.runner.graphs
    size = graphs.bucket(batch) if graphs is not None else None
    entry = graphs.graphs.get((DECODE, size)) if size is not None else None
    if entry is None:
        return None
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        entry[0].replay()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def sync_sites(e, steps: int) -> dict[str, int]:
    """Where the host waits for the device in ``steps`` decode steps: torch's sync debug mode
    (``torch.cuda.set_sync_debug_mode``) warns at every synchronising CUDA call; each warning
    is counted at the innermost frame of our code (``services/``, ``kernels/``) that made it."""
    import traceback
    import warnings

    sites: dict[str, int] = defaultdict(int)

    def record(message, category, filename, lineno, file=None, line=None):
        ours = [f for f in traceback.extract_stack()[:-1]
                if "/services/" in f.filename or "/kernels/" in f.filename]
        where = ours[-1] if ours else None
        key = (f"{where.filename.split('/')[-1]}:{where.lineno} {where.line}" if where
               else f"{filename}:{lineno}")
        sites[key] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                e.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return dict(sites)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="a checkpoint directory or GGUF file (default: the built-in GGUF)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--sampling", choices=("greedy", "mixed", "chat"), default="greedy")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: no graph replays, so every kernel launch is counted")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before launching the next")
    p.add_argument("--host-only", action="store_true",
                   help="the engine's host work per step without the model (module docstring)")
    p.add_argument("--prompt-len", type=int, default=16,
                   help="prompt tokens per request: the decode steps' context starts there")
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine's kv_cache_dtype")
    p.add_argument("--spin-wait", action="store_true",
                   help="CUDA: the wait for a step's tokens spins (CUDA's default event)")
    p.add_argument("--out", default="profile_decode_step.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    if args.host_only and args.sampling != "greedy":
        p.error("--host-only samples greedily (its head has 16 tokens)")
    e = make_engine(args.dtype, args.quantization, max(batches), args.device,
                    args.enforce_eager,
                    False if args.no_async_scheduling else (True if args.host_only else None),
                    args.kv_cache_dtype,
                    args.prompt_len + args.warmup + args.steps + args.profile_steps + 8,
                    args.model)
    if args.host_only:
        host_only(e)
    if args.spin_wait:
        from services.engine import model_runner

        model_runner.copy_done_event = torch.cuda.Event  # CUDA's default: a spinning wait
    rows = [profile_batch(e, b, args.warmup, args.steps, args.profile_steps, args.top, seed=b,
                          sampling=args.sampling, prompt_len=args.prompt_len,
                          spin_wait=args.spin_wait) for b in batches]
    result = {"precision": vars(e.precision), "kv_cache_dtype": e.layout.dtype,
              "prompt_len": args.prompt_len, "device": args.device, "sampling": args.sampling,
              "host_only": args.host_only, "spin_wait": args.spin_wait,
              "threads": args.threads, "steps": args.steps, "torch": torch.__version__,
              "layers": e.model_config.num_hidden_layers, "rows": rows}
    print(f"precision {e.precision}, KV cache {e.layout.dtype}, {args.prompt_len}-token prompts, "
          f"on {args.device}, {args.sampling} sampling, "
          f"{args.threads} thread(s), {args.steps} timed steps, async scheduling "
          f"{'on' if e.async_scheduling else 'off'}"
          f"{', host work only (constant model, CUDA-graph buffers)' if args.host_only else ''}"
          f"{', the wait for a step spins' if args.spin_wait else ''}")
    for r in rows:
        split = ", ".join(f"{k} {v:.2f}" for k, v in r["phase_cpu_ms_per_step"].items())
        gpu = (f", {r['gpu_ms_per_step']:.2f} GPU ms/step (busy {r['gpu_busy_share']:.0%} of "
               f"the wall), host waits {r['host_wait_ms_per_step']:.2f} ms and works "
               f"{r['host_busy_ms_per_step']:.2f}, {r['kernel_launches_per_step']:.0f} launches, "
               f"{r['host_syncs_per_step']:.0f} syncs, {r['async_copies_per_step']:.0f} queued "
               f"copies" if "kernel_launches_per_step" in r else "")
        if r.get("graph_launch_ms") is not None:
            gpu += f", one graph launch {r['graph_launch_ms']:.3f} ms of host"
        print(f"batch {r['batch']:3d}: {r['cpu_ms_per_step']:8.2f} CPU ms/step, "
              f"{r['wall_ms_per_step']:8.2f} wall ms/step, "
              f"{r['aten_ops_per_step']:7.0f} aten ops/step ({r['compute_ops_per_step']:.0f} not "
              f"views), {r['host_reads_per_step']:.0f} host reads{gpu} ({split})")
        for site, n in sorted(r.get("sync_sites_per_step", {}).items(), key=lambda kv: -kv[1]):
            print(f"    sync {n:5.1f}/step at {site}")
        for k in r.get("top_kernels", []):
            print(f"    gpu {k['device_us_per_step']:8.1f} us/step {k['calls_per_step']:5.0f} calls "
                  f"{k['kernel'][:90]}")
        for a in r.get("top_api_calls", []):
            print(f"    api {a['cpu_us_per_step']:8.1f} us/step {a['calls_per_step']:5.1f} calls "
                  f"{a['call']}")
        for o in r["top_ops"]:
            print(f"    {o['op']:32s} {o['calls_per_step']:7.0f} calls "
                  f"{o['self_cpu_ms_per_step']:8.3f} ms self")
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
