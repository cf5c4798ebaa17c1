"""`bench/wire.py` end to end on a small tensor: it moves the bytes both ways and writes its JSON."""

import json

from .conftest import run_bench


def test_wire_bench_small_run(tmp_path, data_dir):
    out = tmp_path / "wire.json"
    proc = run_bench("wire.py", "--mib", "4", "--repeats", "1", "--train-steps", "3", "--data", str(data_dir),
                     "--out", str(out), timeout=300)
    result = json.loads(out.read_text())
    moved = result["transfer"]
    assert moved["payload_bytes"] == 4 << 20 and moved["protocol_wire_bytes"] > moved["payload_bytes"]
    assert moved["ratio"] > 0 and moved["raw_socket_mib_s"] > 0
    assert {(r["codec"], r["compression"]) for r in result["throughput"]} == {
        (c, z) for c in ("raw", "fp16", "bf16", "int8", "int4", "int2") for z in ("none", "lz4")}
    ratios = {(r["tensor"], r["codec"], r["compression"]): r["size_ratio"] for r in result["sizes"]}
    assert ratios[("block weights", "int8", "none")] < 0.3 and ratios[("block weights", "fp16", "none")] < 0.51
    assert ratios[("block weights", "int2", "none")] < ratios[("block weights", "int4", "none")] < 0.16
    assert "node protocol" in proc.stdout
