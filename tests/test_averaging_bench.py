"""bench/averaging.py end to end, at a size that takes seconds: real node processes and gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from averaging import summary  # noqa: E402


def test_averaging_bench_runs_both_systems_and_a_butterfly_round_sends_two_vectors(tmp_path):
    out = tmp_path / "averaging.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "averaging.py"), "--procs", "3", "--params", "30000",
                           "--rounds", "2", "--interval", "1.5", "--warmup", "3", "--warmup-interval", "0.5",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    [row] = result["table"]
    assert row["procs"] == 3 and row["agree"] and row["complete"] and result["warmup"] == 3
    assert row["gloo_round_s"] > 0 and row["spheroid_round_s"] > 0
    ours = next(r for r in result["runs"] if r["system"] == "spheroid")
    # 2 (n - 1) / n of the tensor, plus framing and the odd ping: by the nodes' own counters
    assert 4 / 3 <= ours["node_bytes_per_node"] / result["tensor_bytes"] < 4 / 3 * 1.05
    assert "replicas agree" in proc.stdout
    for system in ("gloo", "spheroid"):  # (CPU in user space and in the kernel, which add up)
        assert row[f"{system}_user_s_per_node"] > 0 and row[f"{system}_sys_s_per_node"] >= 0
        assert row[f"{system}_cpu_s_per_node"] > 0


def run_row(system: str, round_s: float, pair: int, cpu: float, **extra) -> dict:
    return {"system": system, "procs": 8, "round_s": round_s, "cpu_s_per_node": cpu, "user_s_per_node": cpu / 4,
            "sys_s_per_node": cpu * 3 / 4, "loopback_bytes_per_node": 7.0, "pair": pair, **extra}


def test_repeated_pairs_give_the_median_of_their_ratios_and_their_range():
    ok = {"agree": True, "complete": True}
    # in the order main() runs them: the second pair ran spheroid first; each run has its pair's number
    rows = [run_row("gloo", 0.10, 0, 0.020), run_row("spheroid", 0.15, 0, 0.030, **ok),
            run_row("spheroid", 0.12, 1, 0.034, agree=True, complete=False), run_row("gloo", 0.09, 1, 0.019),
            run_row("gloo", 0.08, 2, 0.021), run_row("spheroid", 0.14, 2, 0.032, **ok)]
    row = summary(rows, 8, tensor_bytes=4)
    assert row["pairs"] == 3 and row["time_ratios"] == [0.15 / 0.10, 0.12 / 0.09, 0.14 / 0.08]
    assert row["time_ratio"] == 0.15 / 0.10 and row["time_ratio_min"] == 0.12 / 0.09
    assert row["time_ratio_max"] == 0.14 / 0.08
    assert row["gloo_round_s"] == 0.09 and row["spheroid_round_s"] == 0.14
    assert row["gloo_cpu_s_per_node"] == 0.020 and row["spheroid_cpu_s_per_node"] == 0.032
    assert row["gloo_user_s_per_node"] == 0.020 / 4 and row["spheroid_sys_s_per_node"] == 0.032 * 3 / 4
    assert row["spheroid_bytes_over_tensor"] == 7.0 / 4 and row["agree"] and not row["complete"]
    with pytest.raises(ValueError, match="whole pairs"):
        summary(rows[:-1], 8, tensor_bytes=4)
