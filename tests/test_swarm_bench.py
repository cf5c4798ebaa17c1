"""bench/swarm.py and `spheroid swarm` (what `make demo` runs) end to end, at smoke-test size."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import torch

from spheroid import checkpoint
from spheroid.config import RunConfig
from spheroid.launch import free_port
from spheroid.node.upstream import pick_donor

from .conftest import run_bench


def test_swarm_bench_ci_preset_writes_curves_for_both_configurations(tmp_path, data_dir):
    out = tmp_path / "swarm.json"
    proc = run_bench("swarm.py", "--preset", "ci", "--out", str(out), "--work", str(tmp_path / "work"),
                     "--data", str(data_dir))
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"paper", "best"}
    assert result["link"] == {"delay_ms_one_way": 20.0, "mbit": 50.0}
    for run in result["runs"].values():
        assert run["snapshots"] and all(0 < s["ce"] < 8 and s["bytes"] > 0 for s in run["snapshots"])
        assert all(code == 0 for code in run["exit_codes"].values())
        assert run["link_bytes"] > 0  # node-to-node traffic really crossed the emulated links
    paper, best = (result["runs"][k]["snapshots"][-1]["bytes"] for k in ("paper", "best"))
    assert best < paper  # int2 every 100 steps moves less than fp32 every 10
    assert (tmp_path / "swarm.png").stat().st_size > 0
    assert "final CE" in proc.stdout


def test_spheroid_swarm_trains_assembles_and_stops_cleanly(tmp_path, data_dir):
    out = tmp_path / "demo"
    base = consecutive_free_ports(3)
    proc = subprocess.run(
        [sys.executable, "-m", "spheroid", "swarm", "--out", str(out), "--replicas", "2,1", "--data", str(data_dir),
         "--base-port", str(base), "--", "--steps", "30", "--every", "10", "--d-model", "32", "--n-heads", "2",
         "--layers-per-block", "1", "--context", "32", "--batch", "8"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "all 3 nodes stopped cleanly" in proc.stdout and f"checkpoint: {out / 'model'}" in proc.stdout
    # where each node listens and logs, then a status line per node that names what it shows
    assert f"b1-a | block 1 on 127.0.0.1:{base + 2} | log {out / 'nodes' / 'b1-a.log'}" in proc.stdout
    assert "b0-b | block 0 step" in proc.stdout and "(weighted loss" in proc.stdout
    assert proc.stdout.count("starting") <= 3
    rounds = [json.loads(line) for line in (out / "nodes" / "b0-a" / "worker-0.history.jsonl").read_text().splitlines()]
    assert rounds and rounds[-1]["step"] == 30 and {"loss", "ce", "round"} <= set(rounds[-1])
    metrics = json.loads((out / "metrics.json").read_text())
    hashes = {n["training"]["version"]["hash"] for name, n in metrics["nodes"].items() if name.startswith("b0")}
    assert len(hashes) == 1 and [a["block"] for a in metrics["assembled"]] == [0, 1]
    assert checkpoint.load(out / "model", "block-1").state["round"] >= 1


def test_spheroid_swarm_reference_trains_replicas_that_assemble_score_and_generate(tmp_path, data_dir):
    out = tmp_path / "diloco"
    model = ["--d-model", "32", "--n-heads", "2", "--layers-per-block", "1", "--n-blocks", "2", "--context", "32",
             "--batch", "8"]
    proc = subprocess.run(
        [sys.executable, "-m", "spheroid", "swarm", "--reference", "--replicas", "2", "--out", str(out), "--data",
         str(data_dir), "--", "--steps", "30", "--every", "10", "--outer", "nesterov", "--codec", "int4",
         "--error-feedback", *model],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ref-b | the reference step" in proc.stdout and "all 2 nodes stopped cleanly" in proc.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["reference"] and len({n["training"]["version"]["hash"] for n in metrics["nodes"].values()}) == 1
    assert [a["block"] for a in metrics["assembled"]] == [65535]
    cfg = checkpoint.read_config(out / "model", checkpoint.REFERENCE)
    assert (cfg.model.n_blocks, cfg.model.d_model) == (2, 32) and not checkpoint.block_indices(out / "model")
    scored = subprocess.run([sys.executable, "-m", "spheroid", "eval", str(out / "model"), "--windows", "8", "--json",
                             "--data", str(data_dir)], capture_output=True, text=True, timeout=120)
    assert scored.returncode == 0 and 0 < json.loads(scored.stdout)["reference_ce"] < 8
    text = subprocess.run([sys.executable, "-m", "spheroid", "generate", str(out / "model"), "--prompt", "The ",
                           "--bytes", "20", "--raw"], capture_output=True, timeout=120)
    assert text.returncode == 0 and text.stdout.startswith(b"The ") and len(text.stdout) == len(b"The ") + 20 + 1
    # a count per block is refused with --reference, before any node starts
    bad = subprocess.run([sys.executable, "-m", "spheroid", "swarm", "--reference", "--replicas", "2,1", "--out",
                          str(tmp_path / "bad")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "one count" in bad.stderr


def consecutive_free_ports(n: int) -> int:
    """The first of n consecutive TCP ports on 127.0.0.1 that are free now."""
    for _ in range(50):
        base = free_port()
        if base + n <= 65535 and all(port_is_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports found")


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_joiners_spread_over_donors():
    holders = [f"{i:032x}" for i in range(3)]
    picks = [pick_donor(f"{j:032x}", holders) for j in range(100, 400)]
    assert all(picks.count(h) > 60 for h in holders)  # about 100 each
    assert pick_donor("a" * 32, holders) == pick_donor("a" * 32, list(reversed(holders)))  # order-free


def test_a_damaged_worker_checkpoint_is_refused_with_a_clear_error(tmp_path, data_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "worker-0.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{truncated")
    proc = subprocess.run([sys.executable, "-m", "spheroid", "node", "--block", "0", "--data", str(data_dir),
                           "--identity", str(tmp_path / "id.json"), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "not a readable worker checkpoint" in proc.stderr
    assert "move it away" in proc.stderr and "Traceback" not in proc.stderr
    # as written now: a record and the tensors it verifies, the AdamW state's too (a flipped bit there
    # would otherwise load silently: only the parameters are checked against the state's hash)
    record = {"version": {"round": 1, "samples": 8, "hash": "ab" * 32}, "step": 5, "block": 0, "loss": 1.0,
              "reads": {}}
    checkpoint.save_tensors(out, "worker-0", {"params": torch.zeros(8), "opt.exp_avg.0": torch.zeros(8)}, RunConfig(),
                            record)
    assert not (out / "worker-0.safetensors").exists()  # (the one-file checkpoint gave way)
    [tensors] = out.glob("worker-0.*.safetensors")
    blob = bytearray(tensors.read_bytes())
    blob[-1] ^= 1
    tensors.write_bytes(bytes(blob))
    proc = subprocess.run([sys.executable, "-m", "spheroid", "node", "--block", "0", "--data", str(data_dir),
                           "--identity", str(tmp_path / "id.json"), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "does not match the sha256" in proc.stderr and tensors.name in proc.stderr
