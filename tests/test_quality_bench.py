"""`bench/quality.py --preset ci` end to end, then the CLI's eval and generate on what it trained."""

import gc
import json
import shutil
import subprocess
import sys
import weakref

import pytest
from click.testing import CliRunner

from spheroid import loading
from spheroid.cli import training as cli

from .conftest import ROOT, run_bench


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("quality")
    out = tmp / "quality.json"
    proc = run_bench("quality.py", "--preset", "ci", "--out", str(out), "--work", str(tmp / "work"),
                     "--data", str(data_dir), "--device", "cpu")
    return tmp, json.loads(out.read_text()), proc.stdout


def test_quality_ci_preset_writes_its_json_and_plot(bench_run):
    tmp, result, stdout = bench_run
    for key in ("reference_ce", "single_block_reference_ce", "blocktrain_ce", "blocktrain_ce_m8", "block0_alone_ce",
                "references", "chains", "gap", "depth_pays", "composition", "config", "concurrent_ce"):
        assert key in result, key
    refs = result["references"]
    assert set(refs) == {"reference", "single_block_reference", "reference_two_stream",
                         "single_block_reference_two_stream"}
    for ref in refs.values():
        assert ref["params"] > 0 and ref["train_flops"] > 0 and ref["wall_s"] > 0 and 0 < ref["ce"] < 6.0
    # the bar's figures are the best of each kind, and the differences are what they say
    assert result["reference_ce"] == min(refs["reference"]["ce"], refs["reference_two_stream"]["ce"])
    assert result["single_block_reference_ce"] == min(refs["single_block_reference"]["ce"],
                                                      refs["single_block_reference_two_stream"]["ce"])
    assert result["gap"] == pytest.approx(result["blocktrain_ce"] - result["reference_ce"])
    assert result["depth_pays"] == pytest.approx(result["single_block_reference_ce"] - result["reference_ce"])
    assert result["one_worker_alone_ce"] == min(result["single_block_reference_ce"], result["block0_alone_ce"])
    # the two-stream reference costs more FLOPs than the plain one for the same parameters
    assert refs["reference_two_stream"]["params"] == refs["reference"]["params"]
    assert refs["reference_two_stream"]["train_flops"] > refs["reference"]["train_flops"]
    for chain in ("ordered", "concurrent"):
        c = result["chains"][chain]
        assert c["ce_m8"] <= c["ce"] + 1e-6 and 0 < c["ce"] < 6.0 and len(c["train_flops_per_block"]) == 4
        assert 0 < c["raw"]["ce"] < 6.0
    # even 40 steps teach the reference something about bytes
    assert result["reference_ce"] < 5.2
    assert result["config"]["model"]["n_blocks"] == 4 and result["config"]["model"]["channel"] == "relay"
    # a chain is the chain as trained at its last step only
    assert [row["step"] for row in result["curve"]] == [20, 40]
    assert "blocktrain_ce" not in result["curve"][0] and "concurrent_ce" not in result["curve"][0]
    assert "concurrent_ce" in result["curve"][-1]
    work = tmp / "work"
    reads = json.loads((work / "blocktrain_concurrent" / "block-3.json").read_text())["state"]["reads"]
    # (which versions were published when block 3 read them depends on the machine's load)
    assert sorted(reads) == ["block-0", "block-1", "block-2"]
    assert all(r["sha256"] == "genesis" or r["step"] > 0 for r in reads.values())
    assert (tmp / "quality.png").stat().st_size > 1000
    assert "chain in order, M = 8" in stdout and "depth pays" in stdout


def run_cli(*args, data_dir=None):
    env_args = ["--data", str(data_dir)] if data_dir else []
    return subprocess.run([sys.executable, "-m", "spheroid", *args, *env_args], capture_output=True, text=True,
                          timeout=300)


def test_cli_eval_reports_the_chain_and_block_zero(bench_run, data_dir):
    tmp, result, _ = bench_run
    proc = run_cli("eval", str(tmp / "work" / "blocktrain"), "--draws", "2", "--windows", "8", "--json", "--bound",
                   data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["draws"] == 2 and report["bytes"] == 8 * 32
    assert report["bound_ce"] == pytest.approx(
        report["bound_prior"] + report["bound_diffusion"] + report["bound_reconstruction"])
    assert report["chain_ce"] <= report["chain_ce_m1"] + 1e-6 and "reference_ce" not in report
    proc = run_cli("eval", str(tmp / "work" / "reference"), "--split", "test", "--windows", "8", data_dir=data_dir)
    assert proc.returncode == 0 and "reference, " in proc.stdout and " layers" in proc.stdout and "PPL" in proc.stdout
    # a folder holding both is scored for both, on the same windows (loaded one after the other)
    both = tmp / "both"
    shutil.copytree(tmp / "work" / "blocktrain", both)
    shutil.copytree(tmp / "work" / "reference", both, dirs_exist_ok=True)
    proc = run_cli("eval", str(both), "--draws", "2", "--windows", "8", "--json", data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr
    joint = json.loads(proc.stdout)
    assert joint["chain_ce_m1"] == report["chain_ce_m1"] and joint["reference_layers"] >= 1
    assert joint["reference_ce"] == json.loads(run_cli("eval", str(tmp / "work" / "reference"), "--windows", "8",
                                                        "--json", data_dir=data_dir).stdout)["reference_ce"]


def test_eval_of_a_chain_and_a_reference_holds_one_model_at_a_time(bench_run, data_dir, monkeypatch):
    """The chain is gone before the reference is loaded; a reference of another context is refused
    before the chain is scored, not after."""
    tmp, _, _ = bench_run
    both = tmp / "both-in-process"
    shutil.copytree(tmp / "work" / "blocktrain", both)
    shutil.copytree(tmp / "work" / "reference", both, dirs_exist_ok=True)
    blocks, order = [], []

    def load_chain(folder, device):
        chain = loading.load_chain(folder, device)
        blocks.extend(weakref.ref(b) for b in chain[1])
        order.append("chain")
        return chain

    def load_reference(folder, device):
        gc.collect()
        order.append("reference" if blocks and all(ref() is None for ref in blocks) else "reference, chain alive")
        return loading.load_reference(folder, device)

    monkeypatch.setattr(cli, "load_chain", load_chain)
    monkeypatch.setattr(cli, "load_reference", load_reference)
    result = CliRunner().invoke(cli.main, ["eval", str(both), "--draws", "1", "--windows", "4", "--json",
                                           "--data", str(data_dir)])
    assert result.exit_code == 0, result.output
    assert order == ["chain", "reference"] and "reference_ce" in json.loads(result.stdout)
    record = both / "reference.json"
    changed = json.loads(record.read_text())
    changed["config"]["model"]["context"] += 1
    record.write_text(json.dumps(changed))
    order.clear()
    result = CliRunner().invoke(cli.main, ["eval", str(both), "--data", str(data_dir)])
    assert result.exit_code == 1 and "a reference of context" in result.output and order == []


def test_cli_generate_is_seeded_and_returns_the_bytes_asked_for(bench_run):
    tmp, _, _ = bench_run
    ckpt = str(tmp / "work" / "blocktrain")
    runs = [run_cli("generate", ckpt, "--prompt", "The ", "--bytes", "12", "--k", k, "--seed", "3",
                    "--temperature", "0") for k in ("1", "1", "4")]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.startswith("The ")


def test_cli_errors_are_one_clear_line(tmp_path):
    proc = run_cli("eval", str(tmp_path))
    assert proc.returncode == 1 and "holds neither blocks nor a reference" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "spheroid", "train", "--block", "0", "--data", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_reused_references_must_match_what_they_are_compared_with(bench_run, data_dir):
    """--reuse-references takes an earlier run's references only if their training matches."""
    tmp, _, _ = bench_run
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality.py"), "--preset", "ci",
                           "--work", str(tmp / "again"), "--out", str(tmp / "again.json"), "--data", str(data_dir),
                           "--device", "cpu",
                           "--reuse-references", str(tmp / "work"), "--set", "model.d_model=48"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "trained with another configuration" in proc.stderr
