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
    assert set(modes) == {"ar", "spec", "sweep-8", "sweep-32", "ar-greedy", "spec-greedy", "reference"}
    for m in modes.values():
        assert m["wall_s"] > 0 and m["node_bytes"] > 0 and m["sample_ce_under_reference"] > 0
        assert 1 <= m["traversals"] <= 32 and m["bytes_per_traversal"] == 32 / m["traversals"]
    assert all("valid_ce_m1" in modes[k] for k in ("ar", "spec", "sweep-8", "sweep-32"))
    assert modes["ar"]["traversals"] == 32 and modes["sweep-8"]["traversals"] == 4
    # the bench itself fails unless greedy speculative decoding gave ar's bytes
    assert result["speculative"]["greedy_spec_is_ar"] and result["speculative"]["spec_traversals_vs_ar"] <= 1
    loads = {r["name"]: r for r in result["concurrent"]}
    assert set(loads) == {"ar", "spec", "reference"}
    assert all(r["sessions"] == 4 and r["bytes"] == 4 * 32 and r["bytes_per_s"] > 0 for r in loads.values())
    quality = result["quality_against_k"]
    assert quality["chunks"] == [1, 8, 32]
    for model in ("trained_k1", "trained_mixed"):
        assert set(quality[model]["valid_ce_m1"]) == {"1", "8", "32"}
        assert all(0 <= quality[model][f"{d}_drafts_kept"] <= 1 for d in ("sweep", "lookup"))
    assert "drafts kept" in proc.stdout
    # three hops of 20 ms each way per traversal: 32 traversals cannot beat one by chance
    assert modes["sweep-32"]["wall_s"] < modes["ar"]["wall_s"]
    assert (tmp_path / "inference.png").stat().st_size > 0 and "vs ar" in proc.stdout
