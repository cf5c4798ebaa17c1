"""The command line as a user meets it: resumable training, one-line errors, config files, output."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spheroid.launch import free_port

from .nodes import wait_until

TINY = ["--d-model", "32", "--n-heads", "2", "--layers-per-block", "1", "--context", "32", "--batch", "4",
        "--warmup", "5"]


def spheroid(*args: str | bytes, data_dir: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    extra = ["--data", str(data_dir)] if data_dir else []
    return subprocess.run([sys.executable, "-m", "spheroid", *args, *extra], capture_output=True, timeout=timeout)


def start(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "spheroid", *args], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)


def weights(folder: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(folder / json.loads((folder / f"{name}.json").read_text())["weights"]))


@pytest.fixture(scope="module")
def block0(tmp_path_factory, data_dir) -> Path:
    """A folder with a trained block 0, which block 1 reads (chain states and the relay channel)."""
    folder = tmp_path_factory.mktemp("cli") / "base"
    proc = spheroid("-q", "train", "--block", "0", "--steps", "5", *TINY, "--out", str(folder), data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr
    return folder


def copy_of(folder: Path, to: Path) -> Path:
    to.mkdir()
    for f in folder.glob("block-0.*"):
        (to / f.name).write_bytes(f.read_bytes())
    return to


@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_a_killed_trainer_resumes_to_the_weights_of_an_uninterrupted_run(block0, tmp_path, data_dir, how):
    """SIGINT saves the state at the step it stops after (exit status 130); SIGKILL loses the steps
    since the last periodic save. Either way a rerun ends on the uninterrupted run's weights."""
    flags = ["train", "--block", "1", "--steps", "120", *TINY, "--log-every", "10", "--resume-every", "20",
             "--data", str(data_dir)]
    whole, cut = copy_of(block0, tmp_path / "whole"), copy_of(block0, tmp_path / "cut")
    assert spheroid(*flags, "--out", str(whole)).returncode == 0
    log = tmp_path / "cut.log"
    proc = start(*flags, "--out", str(cut), log=log)
    try:
        wait_until(lambda: "step 40/120" in log.read_text(errors="replace"), 120, "the trainer at step 40")
        proc.send_signal(getattr(signal, how))
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    record = json.loads((cut / "block-1.resume.json").read_text())
    if how == "SIGINT":
        assert code == 130 and "run the same command again to continue" in log.read_text()
        assert 40 <= record["state"]["step"] < 120
    else:
        assert code == -signal.SIGKILL and record["state"]["step"] % 20 == 0
    with (cut / "block-1.history.jsonl").open("a") as f:  # as a kill between logging a step and saving it leaves
        f.write(json.dumps({"step": record["state"]["step"] + 10, "loss": 1.0}) + '\n{"step": 1')
    again = spheroid(*flags, "--out", str(cut))
    assert again.returncode == 0 and f"resumed from {cut} at step {record['state']['step']}" in again.stderr.decode()
    a, b = weights(whole, "block-1"), weights(cut, "block-1")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the loss history continues where it stopped; a third run has nothing to do
    steps = [json.loads(line)["step"] for line in (cut / "block-1.history.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 120
    done = spheroid(*flags, "--out", str(cut))
    assert done.returncode == 0 and "already trained to step 120" in done.stderr.decode()


def test_fresh_starts_over(block0, tmp_path, data_dir):
    out = copy_of(block0, tmp_path / "f")
    flags = ["train", "--block", "1", "--steps", "4", *TINY, "--out", str(out), "--data", str(data_dir)]
    assert spheroid(*flags).returncode == 0
    proc = spheroid(*flags, "--fresh", "--steps", "6")
    assert proc.returncode == 0 and "resumed" not in proc.stderr.decode()
    assert json.loads((out / "block-1.json").read_text())["state"]["step"] == 6


BAD = {
    "steps 0": ["train", "--block", "0", "--steps", "0"],
    "block beyond the model": ["train", "--block", "4"],
    "a block range that is not one": ["train", "--block", "1-"],
    "a block range with --refresh-every": ["train", "--block", "all", "--refresh-every", "5"],
    "heads that do not divide the width": ["train", "--block", "0", "--n-heads", "3"],
    "eval draws 0": ["eval", ".", "--draws", "0"],
    "replicas not numbers": ["swarm", "--replicas", "2,x"],
    "a node flag that does not exist": ["swarm", "--", "--d-modle", "3"],
    "a node flag value that does not fit": ["swarm", "--", "--d-model", "30", "--n-heads", "4"],
    "generate 0 bytes": ["generate", ".", "--bytes", "0"],
    "generate -5 bytes through a peer": ["generate", "--peer", "127.0.0.1:9", "--bytes", "-5", "x"],
    "a NaN temperature": ["generate", "--peer", "127.0.0.1:9", "--temperature", "nan", "x"],
    "a seed of 2^63": ["generate", "--peer", "127.0.0.1:9", "--seed", str(2**63), "x"],
    "a checkpoint folder as the prompt": ["generate", ".", "--peer", "127.0.0.1:9"],
    "an address without a port": ["node", "--listen", "localhost"],
    "a serving range that is not one": ["node", "--serve", "3-1", "--checkpoint", "."],
    "a chunk of 0": ["eval", ".", "--k", "0"],
    "a flag the swarm sets for each node": ["swarm", "--", "--block", "1"],
    "a peer address without a port": ["status", "--peer", "garbage"],
    "a NaN relay loss": ["train", "--block", "0", "--relay-loss", "nan"],
    "an infinite sigma_max": ["train", "--block", "0", "--sigma-max", "inf"],
    "mixed chunk sizes over the context": ["train", "--block", "0", "--context", "32", "--chunks", "1,64"],
    "a log file in a folder that does not exist": ["eval", ".", "--log-file", "/nonexistent/folder/log"],
}
if not torch.cuda.is_available():
    BAD["cuda on a CPU build"] = ["train", "--block", "0", "--device", "cuda"]


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_values_are_refused_up_front_in_one_line_with_status_2(case, tmp_path):
    from click.testing import CliRunner

    from spheroid.cli import main

    args = [str(tmp_path) if a == "." else a for a in BAD[case]]
    (tmp_path / "block-0.json").write_text("{}")  # (a checkpoint folder, as far as the flags' checks look)
    result = CliRunner().invoke(main, args)  # in this process: the same command, without a new interpreter
    err = result.stderr
    assert result.exit_code == 2, err + result.stdout
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("Error: "), err


def test_a_samples_ratio_under_1_is_refused_by_its_flag():
    from click.testing import CliRunner

    from spheroid.cli import main

    result = CliRunner().invoke(main, ["node", "--max-samples-ratio", "0.5"])
    assert result.exit_code == 2 and "'--max-samples-ratio'" in result.stderr and "0.5" in result.stderr


def test_debug_shows_the_traceback_of_an_error(tmp_path, data_dir):
    args = ["train", "--block", "2", "--steps", "2", *TINY, "--out", str(tmp_path)]
    plain = spheroid(*args, data_dir=data_dir)
    assert plain.returncode == 1 and "has no block 0 yet: train it first" in plain.stderr.decode()
    assert "Traceback" not in plain.stderr.decode()
    debug = spheroid(*args, "--debug", data_dir=data_dir)
    assert debug.returncode == 1 and "Traceback" in debug.stderr.decode()


def test_version_help_and_verbosity_on_every_subcommand():
    from click.testing import CliRunner

    from spheroid.cli import main

    version = spheroid("--version")
    assert version.returncode == 0 and version.stdout.decode().startswith("spheroid, version ")
    runner = CliRunner()
    for sub in main.commands:
        text = runner.invoke(main, [sub, "--help"]).output
        assert "--verbose" in text and "--log-file" in text and "--debug" in text, sub
    undocumented = [(name, p.opts) for name, cmd in main.commands.items() for p in cmd.params
                    if p.param_type_name == "option" and not p.help]
    assert not undocumented
    node = runner.invoke(main, ["node", "--help"]).output
    # (node's --reference is its own: replicas of the end-to-end reference, not train's flag)
    assert "DiLoCo" in node.split("  --reference", 1)[1][:400] and "`train` only" not in node


def test_config_takes_a_checkpoint_record_and_refuses_unknown_tables(block0, tmp_path, data_dir):
    out = tmp_path / "from-record"
    proc = spheroid("-q", "train", "--block", "0", "--config", str(block0 / "block-0.json"), "--steps", "3",
                    "--out", str(out), data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((out / "block-0.json").read_text())["config"]
    assert cfg["model"]["d_model"] == 32 and cfg["train"]["steps"] == 3  # the record's model, the flag's steps
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {"d_model": 32}, "optimiser": {}}))
    proc = spheroid("train", "--block", "0", "--config", str(bad))
    assert proc.returncode == 2 and "unknown table(s) ['optimiser']" in proc.stderr.decode()


def test_one_toml_file_holds_a_nodes_flags(tmp_path):
    """The [node] table takes the flags as spelt (`peer`, one or a list); a seed that cannot be reached
    is a warning; generate sent to a node that serves nothing says so, on a line of its own."""
    port = free_port()
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\nlisten = "127.0.0.1:{port}"\nidentity = "{tmp_path / "id.json"}"\n'
                      f'status-interval = 1.0\npeer = "127.0.0.1:1"\n')
    proc = start("node", "--config", str(config), log=tmp_path / "node.log")
    try:
        wait_until(lambda: spheroid("status", "--peer", f"127.0.0.1:{port}", timeout=30).returncode == 0, 60,
                   "the node configured from the file to answer")
        wait_until(lambda: "cannot reach --peer 127.0.0.1:1" in (tmp_path / "node.log").read_text(), 30,
                   "a warning about the seed nothing listens on")
        asked = spheroid("generate", "--peer", f"127.0.0.1:{port}", "", timeout=60)
        assert asked.returncode == 1 and asked.stdout == b"\n"  # (an empty prompt is a prompt)
        assert "serves no blocks: send generate to a node started with --serve" in asked.stderr.decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    config.write_text('[node]\nlissen = "127.0.0.1:1"\n')
    bad = spheroid("node", "--config", str(config))
    assert bad.returncode == 2 and "[node] has no flag(s) ['lissen']" in bad.stderr.decode()


def test_generate_shows_bytes_that_are_not_utf8_and_raw_writes_them_unchanged(block0, tmp_path, data_dir):
    folder, alone = tmp_path / "model", tmp_path / "alone"
    copy_of(block0, folder)
    copy_of(block0, alone)
    train = ["-q", "train", "--steps", "3", *TINY]
    assert spheroid(*train, "--block", "1-3", "--out", str(folder), data_dir=data_dir).returncode == 0
    assert spheroid(*train, "--block", "1", "--out", str(alone), data_dir=data_dir).returncode == 0
    # blocks trained in order in one process are the blocks trained one command each: the same bytes
    assert json.loads((folder / "block-1.json").read_text())["sha256"] == json.loads(
        (alone / "block-1.json").read_text())["sha256"]
    prompt = b"caf\xe9 "  # Latin-1, not UTF-8: taken as the bytes typed
    args = ["generate", str(folder), "--prompt", prompt, "--bytes", "64", "--temperature", "1.5", "--seed", "1"]
    raw, shown = spheroid(*args, "--raw"), spheroid(*args)
    assert raw.returncode == 0 and shown.returncode == 0, shown.stderr
    assert raw.stdout.startswith(prompt) and len(raw.stdout) == len(prompt) + 64 + 1
    from spheroid.cli import CONTROLS  # (control characters are shown as \\xNN too)

    assert shown.stdout.decode("utf-8") == raw.stdout.decode("utf-8", errors="backslashreplace").translate(CONTROLS)
    assert "\\xe9" in shown.stdout.decode()
    ar = spheroid(*args, "--mode", "ar", "--k", "4", "--bytes", "8")  # (ar is a byte a traversal, whatever --k)
    assert ar.returncode == 0 and "8 bytes in 8 traversals" in ar.stderr.decode(), ar.stderr


def test_control_characters_are_shown_not_sent_to_the_terminal(monkeypatch):
    import io

    from spheroid.cli import ByteWriter

    out = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out))
    writer = ByteWriter(raw=False)
    writer.write(b"a\x1b[2Jb\tc\nd\x7f\xc2\x9b", final=True)
    assert out.getvalue() == b"a\\x1b[2Jb\tc\nd\\x7f\\xc2\\x9b"  # (U+009B's two bytes, as they came)


def test_a_folder_with_only_an_unfinished_run_or_a_missing_block_0_says_what_it_holds(tmp_path, data_dir):
    from click.testing import CliRunner

    from spheroid import checkpoint
    from spheroid.cli import main
    from spheroid.config import ModelConfig, RunConfig
    from spheroid.model import DiffusionBlock

    cfg = RunConfig(model=ModelConfig(d_model=32, n_heads=2, layers_per_block=1, context=32))
    checkpoint.save(tmp_path, "block-0.resume", DiffusionBlock(cfg.model, 0.5, 0), cfg, {"step": 3})
    result = CliRunner().invoke(main, ["eval", str(tmp_path), "--data", str(data_dir)])
    assert result.exit_code == 1 and "only the resumable state of an unfinished run (block-0); run the same train " \
                                     "command again" in result.stderr
    checkpoint.save(tmp_path, "block-1", DiffusionBlock(cfg.model, 0.5, 1), cfg, {"step": 3})
    result = CliRunner().invoke(main, ["eval", str(tmp_path), "--data", str(data_dir)])
    assert result.exit_code == 1 and "lacks block(s) [0, 2, 3] of 4" in result.stderr, result.stderr


def test_a_server_that_is_not_a_spheroid_node_gets_a_clear_error(tmp_path):
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def answer_http() -> None:
        conn, _ = server.accept()
        conn.recv(1024)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        time.sleep(1)
        conn.close()

    threading.Thread(target=answer_http, daemon=True).start()
    proc = spheroid("status", "--peer", f"127.0.0.1:{server.getsockname()[1]}", timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "does not speak the spheroid protocol" in err and "Traceback" not in err
    # one that accepts and says nothing: an answer within the timeout, not a hang
    proc = spheroid("status", "--peer", f"127.0.0.1:{server.getsockname()[1]}", "--timeout", "2", timeout=60)
    server.close()
    assert proc.returncode == 1 and "sent no spheroid hello within 2s" in proc.stderr.decode()


def test_serving_blocks_the_model_does_not_have_says_which_it_has(block0, tmp_path):
    proc = spheroid("node", "--listen", f"127.0.0.1:{free_port()}", "--identity", str(tmp_path / "id.json"),
                    "--serve", "0-5", "--checkpoint", str(block0), timeout=60)
    assert proc.returncode == 1 and "the model in" in proc.stderr.decode() and "has blocks 0-3" in proc.stderr.decode()


def test_files_that_cannot_be_read_and_a_run_out_of_memory_name_what_to_change(tmp_path, data_dir):
    from click.testing import CliRunner

    from spheroid.cli import main
    from spheroid.model import load_genesis_codebook
    from spheroid.node.identity import IdentityError, load_or_create

    with pytest.raises(IdentityError, match=r"cannot keep the identity /proc/nope/id.json \(--identity\)"):
        load_or_create("/proc/nope/id.json")
    with pytest.raises(ValueError, match=r"cannot read the genesis codebook .*nope \(--codebook-file\)"):
        load_genesis_codebook(str(tmp_path / "nope"), "ab" * 32, (256, 32))
    result = CliRunner().invoke(main, ["train", "--block", "0", *TINY, "--batch", "10000000000", "--out",
                                       str(tmp_path / "big"), "--data", str(data_dir)])
    assert result.exit_code == 1 and "not enough memory (" in result.stderr and "lower --batch" in result.stderr
    assert "Traceback" not in result.stderr
