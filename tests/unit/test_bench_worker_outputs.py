"""scripts/bench_worker_outputs.py runs small and writes what it prints; its stand-in streams
carry what a followed request's outputs carry (nothing here is timed)."""
from __future__ import annotations

import asyncio
import json
import sys

from scripts import bench_worker_outputs
from services.engine.outputs import RequestOutput
from services.runtime.worker import WorkerRuntime


def test_the_benchmark_writes_cpu_per_token_and_message_bytes(tmp_path, monkeypatch, capsys):
    out = tmp_path / "outputs.json"
    monkeypatch.setattr(sys, "argv", ["bench_worker_outputs", "--batches", "1,4", "--steps", "3",
                                      "--rounds", "2", "--out", str(out)])
    bench_worker_outputs.main()
    rows = json.loads(out.read_text())["results"]
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["cpu_us_per_token"] > 0 for r in rows)
    assert rows[1]["bytes_per_step"] > 3 * rows[0]["bytes_per_step"]  # one update per request
    assert "batch    4:" in capsys.readouterr().out


def test_each_output_reaches_the_follow_stream_as_its_request_update():
    async def run():
        rt, follow, rids = bench_worker_outputs._followed_streams(2)
        WorkerRuntime._dispatch(rt, [RequestOutput(rids[0], [7], None, 16, 1),
                                     RequestOutput(rids[1], [8], None, 16, 1)])
        WorkerRuntime._dispatch(rt, [RequestOutput(rids[0], [9], "stop", 16, 2)])
        updates = await follow.take()
        return rt, updates

    rt, updates = asyncio.run(run())
    first_id, second_id = rt.streams
    assert [(u.request_id, list(u.token_ids), u.num_output_tokens, u.finish_reason)
            for u in updates] == [(first_id, [7, 9], 2, "stop"), (second_id, [8], 1, "")]
    first = rt.streams[updates[0].request_id]
    assert first.finished and first.done.done()  # the finishing output ends its Decode call
