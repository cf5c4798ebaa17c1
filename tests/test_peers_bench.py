"""`bench/peers.py --preset ci`: e2e, DiLoCo and BlockTrain on the same FLOPs, the JSON's shape."""

from __future__ import annotations

import json

from .conftest import run_bench

ROW_KEYS = {"name", "transport", "workers", "ce", "bytes_total", "bytes_max_worker", "train_flops",
            "train_flops_max_worker", "peak_rss_mb_max_worker", "train_memory_mb_max_worker", "wall_s", "curve"}


def test_peers_bench_ci_preset_runs_every_method_on_the_same_compute(tmp_path, data_dir):
    out = tmp_path / "peers.json"
    proc = run_bench("peers.py", "--preset", "ci", "--out", str(out), "--work", str(tmp_path / "work"),
                     "--data", str(data_dir))
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["e2e", "diloco", "blocktrain"]
    for row in rows.values():
        assert ROW_KEYS <= set(row) and 0 < row["ce"] < 8 and len(row["curve"]) >= 2
        assert row["curve"][-1][1] == row["ce"] and row["train_flops"] > 0 and row["peak_rss_mb_max_worker"] > 0
        assert all(m["total"] > 0 for m in row["memory_mb"].values())
    e2e, diloco, blocks = rows["e2e"], rows["diloco"], rows["blocktrain"]
    assert (e2e["transport"], e2e["workers"], e2e["bytes_total"]) == ("local", 1, 0)
    assert diloco["transport"] == blocks["transport"] == "node" and diloco["workers"] == blocks["workers"] == 2
    assert diloco["bytes_max_worker"] > 0 and blocks["bytes_max_worker"] > 0
    # the same compute: the workers' own FLOP counts agree within 10% across rows
    flops = [r["train_flops"] for r in rows.values()]
    assert max(flops) / min(flops) - 1 <= 0.10 and result["config"]["flops_matched"]
    # the block workers hold frozen copies of earlier blocks; the reference's replicas hold none
    assert max(m["frozen"] for m in blocks["memory_mb"].values()) > 0
    assert all(m["frozen"] == 0 for m in diloco["memory_mb"].values())
    assert result["grid"] and result["grid"][0]["ce"] == diloco["ce"]
    assert {c["name"] for c in result["projection_check"]} == set(rows)
    assert len(result["projection"]["shapes"]) >= 3
    assert result["command"].startswith("python bench/peers.py --preset ci") and "commit" in result
    assert (tmp_path / "peers.png").stat().st_size > 0 and "diloco grid" in proc.stdout
