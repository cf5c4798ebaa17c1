"""`bench/wire.py` end to end on a small tensor: it moves the bytes both ways and writes its JSON."""

import json
import subprocess
import sys

from .conftest import ROOT


def test_wire_bench_small_run(tmp_path, data_dir):
    out = tmp_path / "wire.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "wire.py"), "--mib", "4", "--repeats", "1", "--train-steps", "12",
         "--data", str(data_dir), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    moved = result["transfer"]
    assert moved["payload_bytes"] == 4 << 20 and moved["protocol_wire_bytes"] > moved["payload_bytes"]
    assert moved["ratio"] > 0 and moved["raw_socket_mib_s"] > 0
    assert {(r["codec"], r["compression"]) for r in result["throughput"]} == {
        (c, z) for c in ("raw", "fp16", "bf16", "int8") for z in ("none", "lz4")}
    ratios = {(r["tensor"], r["codec"], r["compression"]): r["size_ratio"] for r in result["sizes"]}
    assert ratios[("block weights", "int8", "none")] < 0.3 and ratios[("block weights", "fp16", "none")] < 0.51
    assert "node protocol" in proc.stdout
