"""`bench/compose.py --preset ci` end to end: every variant gets a row, reused blocks are not retrained."""

import json

from .conftest import run_bench


def test_compose_ci_preset_writes_one_row_per_variant(tmp_path, data_dir):
    out = tmp_path / "compose.json"
    proc = run_bench("compose.py", "--preset", "ci", "--out", str(out), "--work", str(tmp_path / "work"),
                     "--data", str(data_dir), "--device", "cpu")
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["variants"]}
    assert list(rows) == ["paper", "paper_2steps", "chain_input", "genesis", "relay"]
    assert rows["paper"]["config"]["model"]["channel"] == "z" and rows["relay"]["config"]["model"]["channel"] == "relay"
    assert rows["genesis"]["config"]["model"]["codebook_file"].endswith("genesis-codebook.safetensors")
    assert rows["paper_2steps"]["reuses"] == "paper" and rows["paper_2steps"]["train_wall_s"] == 0
    assert rows["paper_2steps"]["config"]["noise"]["steps_per_block"] == 2
    assert rows["chain_input"]["method_change"] and rows["chain_input"]["config"]["train"]["block_input"] == "chain"
    for r in rows.values():
        assert 0 < r["blocktrain_ce"] <= r["blocktrain_ce_m1"] + 1e-6 < 6.5
        assert r["gap"] == r["blocktrain_ce"] - result["references"]["reference"]["ce"]
        assert r["bound_ce"] == sum(r["bound_terms"].values()) and r["bound_terms"]["prior"] > 0
    assert (tmp_path / "compose.png").stat().st_size > 1000
    assert "chain_input" in proc.stdout
