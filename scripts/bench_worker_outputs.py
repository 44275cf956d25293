"""CPU per output token of a worker's output path, in process (``python -m
scripts.bench_worker_outputs``).

What a decode (or unified) worker's event loop does with each step's outputs when a gateway
follows the worker: ``WorkerRuntime._dispatch`` hands each ``RequestOutput`` to its request's
``_DecodeStream.put_nowait``, which builds the request's ``DecodeResponse`` and queues it on the
``FollowStream``; the stream's ``take()`` then hands the step's updates to one
``FollowResponse``, serialized here as gRPC would. That loop shares the GIL with the engine
thread, so on a GPU, where a step of 64 takes 1-2 ms, every microsecond per token here is time
the engine thread cannot launch the next step (docs/benchmarks.md, serving CPU).

Per batch size (``--batches``, default 16, 64, 256): ``--steps`` steps of one plain token per
request (no logprobs, not finishing), timed in CPU seconds (``time.process_time``), best of
``--rounds``; the engine's own work (building the ``RequestOutput`` objects) is done before the
clock starts. The streams are built without a gRPC call or an engine (``_followed_streams``), so a
change to ``_DecodeStream``'s fields must be mirrored there (the unit test runs this script).

Prints one line per batch and writes JSON (``--out``). Compare figures only within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import types
from pathlib import Path

from services.api import worker_pb2
from services.decode.server import FollowStream, _DecodeStream
from services.engine.outputs import RequestOutput
from services.runtime.worker import WorkerRuntime


def _followed_streams(batch: int) -> tuple[types.SimpleNamespace, FollowStream, list[str]]:
    """A stand-in runtime, one Follow stream and ``batch`` decoding requests on it, in the
    state ``_DecodeStream._follow_outputs`` leaves them: (runtime, stream, request ids)."""
    rt = types.SimpleNamespace(worker_id="bench", options=types.SimpleNamespace(kv_lease_s=60.0),
                               died=asyncio.Event(), handed_back=False, streams={})
    rt.check_output = lambda out: WorkerRuntime.check_output(rt, out)
    follow = FollowStream(rt, "bench-follower-0000")
    loop = asyncio.get_running_loop()
    for i in range(batch):
        s = _DecodeStream.__new__(_DecodeStream)
        s.rt, s.rid, s.follow = rt, f"cmpl-{i:08x}-0000-0000-0000-000000000000", follow
        s.req = types.SimpleNamespace(num_cached_tokens=0)
        s.kv_recomputed, s.computed_here, s.finished = "", False, False
        s.done = loop.create_future()
        rt.streams[s.rid] = follow.requests[s.rid] = s
    return rt, follow, list(rt.streams)


async def measure(batch: int, steps: int, rounds: int) -> dict:
    """Best CPU microseconds per output token of the path over ``rounds`` rounds of ``steps``
    steps, and the serialized bytes per step."""
    rt, follow, rids = _followed_streams(batch)
    best, nbytes = float("inf"), 0
    for _ in range(rounds):
        outputs = [[RequestOutput(r, [1000 + step % 7], None, 16, step + 1) for r in rids]
                   for step in range(steps)]
        t0 = time.process_time()
        for outs in outputs:
            WorkerRuntime._dispatch(rt, outs)
            nbytes = len(worker_pb2.FollowResponse(updates=await follow.take()).SerializeToString())
        best = min(best, (time.process_time() - t0) / (steps * batch) * 1e6)
    return {"batch": batch, "cpu_us_per_token": best, "bytes_per_step": nbytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="16,64,256")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default="bench_worker_outputs.json")
    args = p.parse_args()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        row = asyncio.run(measure(batch, args.steps, args.rounds))
        rows.append(row)
        print(f"batch {batch:4d}: {row['cpu_us_per_token']:6.2f} CPU us per output token, "
              f"{row['bytes_per_step']} bytes per step's Follow message")
    Path(args.out).write_text(json.dumps({"steps": args.steps, "rounds": args.rounds,
                                          "results": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
