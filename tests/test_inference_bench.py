"""bench/inference.py end to end at smoke-test size: every mode measured, JSON and plot written."""

from __future__ import annotations

import json

from .conftest import run_bench


def test_inference_bench_ci_preset(tmp_path, data_dir):
    out = tmp_path / "inference.json"
    proc = run_bench("inference.py", "--preset", "ci", "--out", str(out), "--work", str(tmp_path / "work"),
                     "--data", str(data_dir))
    result = json.loads(out.read_text())
    modes = {m["name"]: m for m in result["modes"]}
    assert set(modes) == {"ar", "sweep-8", "sweep-32", "reference"}
    for m in modes.values():
        assert m["wall_s"] > 0 and m["node_bytes"] > 0 and m["sample_ce_under_reference"] > 0
    assert all("valid_ce_m1" in modes[k] for k in ("ar", "sweep-8", "sweep-32"))
    # three hops of 20 ms each way per traversal: 32 traversals cannot beat one by chance
    assert modes["sweep-32"]["wall_s"] < modes["ar"]["wall_s"]
    assert (tmp_path / "inference.png").stat().st_size > 0 and "vs ar" in proc.stdout
