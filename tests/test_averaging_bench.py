"""bench/averaging.py end to end, at a size that takes seconds: real node processes and gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_averaging_bench_runs_both_systems_and_a_butterfly_round_sends_two_vectors(tmp_path):
    out = tmp_path / "averaging.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "averaging.py"), "--procs", "3", "--params", "30000",
                           "--rounds", "2", "--interval", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    [row] = result["table"]
    assert row["procs"] == 3 and row["agree"] and row["complete"]
    assert row["gloo_round_s"] > 0 and row["spheroid_round_s"] > 0
    ours = next(r for r in result["runs"] if r["system"] == "spheroid")
    # 2 (n - 1) / n of the tensor, plus framing and the odd ping: by the nodes' own counters
    assert 4 / 3 <= ours["node_bytes_per_node"] / result["tensor_bytes"] < 4 / 3 * 1.05
    assert "replicas agree" in proc.stdout
