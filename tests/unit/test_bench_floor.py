"""scripts/bench_floor.py (issue 27): the floor it prints is the engine's resident weight bytes
over the bandwidth it measured, per thread count, and the JSON says which precision it timed."""
from __future__ import annotations

import json

from scripts import bench_floor


def test_floor_is_weight_bytes_over_measured_bandwidth(tmp_path, capsys):
    out = tmp_path / "floor.json"
    assert bench_floor.main(["--rounds", "1", "--tokens", "2", "--buffer-mb", "64",
                             "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["precision"] == "float32:q4_1"  # the GGUF's own blocks, in place
    assert result["weight_bytes"] > 50e6
    assert "1" in result["by_threads"]
    for row in result["by_threads"].values():
        expected = result["weight_bytes"] / (row["read_gbps_best"] * 1e9) * 1e3
        assert abs(row["floor_ms"] - expected) < 1e-9 * expected
        assert row["tpot_over_floor"] == row["tpot_ms_best"] / row["floor_ms"]
        assert len(row["tpot_ms"]) == 1 and row["tpot_ms_best"] > 0
    assert "TPOT/floor" in capsys.readouterr().out
