"""Swarm training with real nodes: separate processes through the CLI, real sockets on 127.0.0.1.

Rounds here are short (a tiny model, a few local steps), deadlines are a second or two, and every
timing check has a margin of seconds: the round logic itself is tested under a fake clock in
test_averaging.py.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from spheroid import checkpoint
from spheroid.averaging import SharedState, state_hash
from spheroid.node.client import with_holder_notes
from spheroid.wire import encode, stream_frames
from spheroid.wire.messages import StateReply

from .nodes import NodeProcess, RawPeer, handshake_then, hello, stop_all, wait_until

TINY = ["--d-model", "32", "--n-heads", "2", "--layers-per-block", "1", "--context", "32", "--batch", "8",
        "--threads", "1"]
MARGIN = 2.0  # seconds of slack on any deadline check (the machine may be busy)


@pytest.fixture
def swarm(tmp_path, data_dir):
    """Start trainer nodes: swarm(name, block, *flags, seed=NodeProcess or None); block "reference" trains
    a replica of the end-to-end reference. All are reaped."""
    nodes: list[NodeProcess] = []

    def start(name: str, block: int | str, *flags: str, seed: NodeProcess | None = None, port: int | None = None):
        part = ["--reference"] if block == "reference" else ["--block", str(block)]
        args = [*part, "--data", str(data_dir), "--out", str(tmp_path / f"{name}-ckpt"), *TINY, *flags]
        if seed is not None:
            args += ["--peer", seed.addr]
        node = NodeProcess(tmp_path, name, *args, port=port).start()
        nodes.append(node)
        return node

    yield start
    stop_all(nodes)


def training(node: NodeProcess) -> dict:
    return node.status()["training"]


def all_done_and_equal(nodes: list[NodeProcess]):
    states = [training(n) for n in nodes]
    if all(s["done"] for s in states) and len({s["version"]["hash"] for s in states}) == 1:
        return states
    return None


def test_replicas_average_in_step_and_the_swarm_assembles(swarm, tmp_path, data_dir):
    """All blocks train at once (chain states, the relay channel): each later block fetches the
    earlier blocks from their holders and records what it read, down to the assembled checkpoint."""
    flags = ["--steps", "60", "--every", "10", "--wait", "5", "--refresh-every", "20"]
    a = swarm("a", 0, *flags)
    b = swarm("b", 0, *flags, seed=a)
    others = [swarm(f"blk{i}", i, *flags, seed=a) for i in (1, 2, 3)]
    states = wait_until(lambda: all_done_and_equal([a, b]), 120, "block 0's replicas to finish in agreement")
    for s in states:
        assert s["round"] == 6 and s["version"]["samples"] == 2 * 60 * 8
        assert s["counters"]["rejected"] == 0
        assert sum(h["updates"] == 2 for h in s["history"]) >= 5  # averaged together, not alone
    wait_until(lambda: all(training(n)["done"] for n in others), 120, "blocks 1-3 to finish")
    for block, node in enumerate(others, start=1):
        earlier = training(node)["earlier"]
        assert sorted(earlier["reads"]) == [f"block-{b}" for b in range(block)]
        assert earlier["fetches"] >= block and earlier["bytes"] > 0  # every earlier block, at least once
        assert all(read["round"] >= 1 for read in earlier["reads"].values())  # trained states, not genesis
    out = tmp_path / "assembled"
    run = subprocess.run([sys.executable, "-m", "spheroid", "assemble", "--peer", b.addr, "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"block 0: round 6, 960 samples, state {states[0]['version']['hash'][:12]}" in run.stdout
    for block in range(4):
        record = json.loads((out / f"block-{block}.json").read_text())
        assert record["state"]["round"] == 6
        assert sorted(record["state"]["reads"]) == [f"block-{b}" for b in range(block)]
    ev = subprocess.run([sys.executable, "-m", "spheroid", "eval", str(out), "--data", str(data_dir), "--windows", "8",
                         "--draws", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr
    assert 0 < json.loads(ev.stdout)["chain_ce_m1"] < 6


@pytest.mark.parametrize("codec, extra, size", [("int8", [], 0.3), ("int4", ["--error-feedback"], 0.17)])
def test_quantized_updates_still_give_replicas_one_state(swarm, codec, extra, size):
    flags = ["--steps", "30", "--every", "10", "--wait", "5", "--codec", codec, "--lz4", *extra]
    a = swarm("a", 0, *flags)
    b = swarm("b", 0, *flags, seed=a)
    states = wait_until(lambda: all_done_and_equal([a, b]), 120, "the replicas to finish in agreement")
    assert sum(h["updates"] == 2 for h in states[0]["history"]) >= 2  # averaged together, bit-identically
    assert states[0]["averaging"]["feedback"] == bool(extra)
    chunks = a.status()["traffic_by_type"]["sent"]["stream_chunk"]
    assert chunks["wire_bytes"] < size * chunks["raw_bytes"]  # 1/4 or 1/8 of fp32, plus scales and framing


def test_slow_peer_misses_the_deadline_and_the_others_keep_time(swarm):
    flags = ["--every", "5", "--wait", "1"]
    a = swarm("a", 0, *flags, "--steps", "60")
    b = swarm("b", 0, *flags, "--steps", "60", seed=a)
    slow = swarm("slow", 0, *flags, "--steps", "10000", "--batch", "2048", seed=a)  # same model, 256x the work
    states = wait_until(lambda: [s for s in (training(a), training(b)) if s["done"]] or None, 180,
                        "the fast replicas to finish")
    for s in states:
        assert s["step"] == 60 and s["round"] >= 6
        assert all(h["waited_s"] <= 1 + MARGIN for h in s["history"])
    histories = [training(n)["history"] for n in (a, b)]
    assert any(h["updates"] == 2 for hist in histories for h in hist), histories  # it missed rounds
    assert training(slow)["step"] < 10000


def test_sigkill_mid_round_then_restart_catches_up_to_the_same_hash(swarm, tmp_path):
    flags = ["--every", "10", "--wait", "2", "--steps", "400", "--batch", "16"]
    a = swarm("a", 0, *flags)
    b = swarm("b", 0, *flags, seed=a)
    c = swarm("c", 0, *flags, seed=a)
    wait_until(lambda: training(c)["round"] >= 3, 120, "three rounds with the victim")
    c.kill()  # SIGKILL: no goodbye, in whatever round it was
    killed_at = training(a)["round"]
    wait_until(lambda: training(a)["round"] >= killed_at + 3, 60, "the survivors to go on")
    for node in (a, b):
        after = [h for h in training(node)["history"] if h["round"] >= killed_at]
        assert after and all(h["waited_s"] <= 2 + MARGIN for h in after)
    # its checkpoint records a hash its state does not have (a round whose owner sent wrong leaf
    # digests agrees on one): the file is intact, so it resumes under its state's own hash
    record_file = tmp_path / "c-ckpt" / "worker-0.json"
    record = json.loads(record_file.read_text())
    record["state"]["version"]["hash"] = "ab" * 32
    record_file.write_text(json.dumps(record))
    c.start()  # same identity, same --out: it resumes from its last round's checkpoint
    wait_until(lambda: training(c)["counters"]["adopted"] >= 1, 60, "the restarted node to catch up")
    states = wait_until(lambda: all_done_and_equal([a, b, c]), 180, "all three to end on one state")
    assert len({s["version"]["hash"] for s in states}) == 1
    resumed = re.search(r"resumed from .* step (\d+), loss (\S+),", c.log.read_text())
    assert resumed and int(resumed[1]) > 0 and math.isfinite(float(resumed[2]))  # its last loss came back too
    assert f"records state {'ab' * 6} but holds state" in c.log.read_text()


def test_joiners_with_no_state_get_the_donors_exact_hash(swarm):
    flags = ["--every", "5", "--wait", "2"]
    d1 = swarm("d1", 0, *flags, "--steps", "30")
    d2 = swarm("d2", 0, *flags, "--steps", "30", seed=d1)
    donors = wait_until(lambda: all_done_and_equal([d1, d2]), 120, "the donors to finish")
    joiners = [swarm(f"j{i}", 0, *flags, "--steps", "0", seed=d1 if i % 2 else d2) for i in range(3)]
    states = wait_until(lambda: all_done_and_equal([d1, d2, *joiners]), 60, "the joiners to sync")
    assert {s["version"]["hash"] for s in states} == {donors[0]["version"]["hash"]}
    # every joiner fetched the state once: from a donor, or from a joiner that already held it
    assert sum(training(n)["served"] for n in (d1, d2, *joiners)) >= 3


def _update_frames(status: dict, delta: torch.Tensor, **fields) -> bytes:
    t = status["training"]
    ids = itertools.count(100)
    frames = b"".join(o.frame for o in stream_frames(delta, 1, lambda: next(ids)))
    message = {"t": "update", "id": 99, "block": 0, "round": t["round"], "base": t["version"]["hash"],
               "samples": 8, "lo": 0, "hi": t["params"], "age": 0.0, "stream": 1, **fields}
    # then something the node refuses, so it answers and closes and the exchange ends at once
    return frames + encode(message) + encode({"t": "no_such_type", "id": 1000})


def test_bad_updates_from_the_wire_are_rejected_and_the_node_keeps_training(swarm):
    node = swarm("a", 0, "--every", "5", "--wait", "1", "--steps", "100000")
    wait_until(lambda: training(node)["round"] >= 1, 60, "the node to train")
    status = node.status()
    n = status["training"]["params"]
    handshake_then(node.addr, _update_frames(status, torch.full((n,), float("nan"))))
    handshake_then(node.addr, _update_frames(status, torch.zeros(n + 1)))
    handshake_then(node.addr, _update_frames(status, torch.zeros(n), round=0, base="0" * 64))
    handshake_then(node.addr, _update_frames(status, torch.zeros(n), round=10**6))
    got = handshake_then(node.addr, encode({"t": "update", "id": 5, "block": 0, "round": 1, "base": "x", "samples": 1,
                                            "lo": 0, "hi": n, "age": 0.0, "stream": 42}))  # names no stream
    assert got[-1]["t"] == "error" and got[-1]["code"] == "bad_stream"
    counters = wait_until(lambda: (c := training(node)["counters"])["rejected"] + c["late"] >= 4 and c, 30,
                          "the rejections to be counted")
    assert counters["accepted"] == 0
    before = training(node)["step"]
    wait_until(lambda: training(node)["step"] > before, 30, "training to go on")
    log = node.log.read_text()
    assert "NaN, Inf" in log and "wrong shape" in log
    # five state requests in one write: two snapshots stream at once, the other three hear busy
    peer = RawPeer(node.addr, timeout=30)
    try:
        peer.send(hello(role="worker"))
        peer.receive()
        peer.send_raw(b"".join(encode({"t": "state_get", "id": 10 + i, "block": 0}) for i in range(5)))
        answers = []
        while len(answers) < 5:
            message, _ = peer.receive()
            if message["t"] in ("state_reply", "error"):
                answers.append(message.get("code", message["t"]))
    finally:
        peer.close()
    assert sorted(answers) == ["busy", "busy", "busy", "state_reply", "state_reply"]


def test_int2_refreshes_send_the_change_from_the_copy_held(swarm):
    """A reader of block 0 with --refresh-codec int2 fetches the change from the copy it holds (at
    first block 0's genesis, which the holder keeps, in int8 if more than a round has passed; then
    the copy the holder made for it, in int2: about a twentieth of a snapshot), and never a
    snapshot, since the holder tracks the copy."""
    flags = ["--steps", "60", "--every", "10", "--wait", "5", "--refresh-every", "10"]
    holder = swarm("holder", 0, *flags)
    reader = swarm("reader", 1, *flags, "--refresh-codec", "int2", seed=holder)
    wait_until(lambda: training(holder)["done"] and training(reader)["done"], 120, "both blocks to finish")
    earlier = training(reader)["earlier"]
    read = earlier["reads"]["block-0"]
    n_params = training(holder)["params"]
    assert earlier["fetches"] >= 3 and read["round"] >= 3
    assert earlier["changes"] >= 2 and earlier["snapshots"] == 0  # every refresh a change from the copy held
    assert read["exact"] is False  # a copy brought up to date by changes, not a snapshot
    # (a float32 snapshot: 4 bytes a value; int8 a quarter of that, int2 a sixteenth, and scales)
    assert 0 < earlier["bytes"] < (0.27 + (earlier["fetches"] - 1) * 0.07) * 4 * n_params


def test_a_joiner_trains_the_rest_of_its_holders_round_and_sends_its_update_with_it(swarm):
    """A node that fetches a state while its holder trains that state's round trains only the share
    of the round's steps the holder had left (`state_reply.left`), so that its first update makes
    the holder's round; trained whole, it would come a round late, and again every round after."""
    flags = ["--every", "400", "--wait", "4", "--steps", "4000"]  # (a row waits 2 s for a joiner: a loaded machine)
    holder = swarm("holder", 0, *flags)
    wait_until(lambda: training(holder)["round"] >= 1, 120, "the holder's first round")
    joiner = swarm("joiner", 0, *flags, seed=holder)
    history = wait_until(lambda: training(joiner)["history"] or None, 120, "the joiner's first round")
    # (its first round is that share of 400 steps; or, if the holder's version came only after it
    # had started training from genesis, as on a loaded machine, its steps so far, rebased onto the
    # state as it comes, and then that share: either way with the holder's round)
    assert history[0]["updates"] == 2
    # and the holder's round of that state counted it too
    held = wait_until(lambda: [h for h in training(holder)["history"] if h["round"] == history[0]["round"]] or None,
                      60, "the holder to close that round")
    assert held[0]["updates"] == 2


def test_what_a_holder_says_of_its_next_round_is_checked():
    """`members` must be node ids and `left` a share of a round: a holder that says otherwise is
    refused (its state is not used; the fetcher tries another holder)."""
    state = SharedState.create(3, 24, torch.zeros(4), None)
    reply = dict(re=1, block=0, round=3, samples=24, hash=state.version.hash, stream=1, config={})
    good = with_holder_notes(state, StateReply(**reply, members=["ab" * 16], left=0.25))
    assert good.members == ("ab" * 16,) and good.left == 0.25
    assert with_holder_notes(state, StateReply(**reply)).left is None
    for bad in ({"left": 1.5}, {"left": -0.1}, {"left": math.nan}, {"members": ["not an id"]}):
        with pytest.raises(ValueError):
            with_holder_notes(state, StateReply(**reply, **bad))


def test_a_holder_averaging_its_round_serves_a_joiner_the_next_rounds_state(swarm):
    """A joiner that asks while its holder averages a round (steps trained, waiting for a peer's
    parts) is served once that round has closed: the state the next round starts from, with the
    whole round to train. Served at once, it would get the state of a round about to close, with
    none of its steps left, and its first update would come a round late. But a joiner that says it
    waits less than that (`within`) is served the state as it is before it gives up. The peer
    holding the round open here is the test itself: in step with the holder, it sends no parts."""
    node = swarm("holder", 0, "--every", "10", "--wait", "5", "--steps", "100000")
    wait_until(lambda: training(node)["round"] >= 1, 60, "the holder's first round")
    peer = RawPeer(node.addr, timeout=30)
    try:
        peer.send(hello(role="worker", blocks=[0]))
        while True:  # (echo the holder's version as one in step with it: it lays out its next round with this peer)
            message, _ = peer.receive()
            if message["t"] == "version":
                peer.send({**message, "id": 2, "synced": True})
            elif message["t"] == "update":  # its part of that round: it now waits for this peer's part
                break
        averaging = message["round"]
        asked = time.monotonic()
        peer.send({"t": "state_get", "id": 9, "block": 0, "within": 1.0})
        while (impatient := peer.receive()[0])["t"] != "state_reply":
            pass
        answered = time.monotonic() - asked
        peer.send({"t": "state_get", "id": 10, "block": 0})
        while (message := peer.receive()[0])["t"] != "state_reply":
            pass
        waited = time.monotonic() - asked
    finally:
        peer.close()
    assert impatient["round"] == averaging and answered < 0.8 + MARGIN  # (ignoring `within`: 5 s, the close)
    assert message["round"] == averaging + 1 and message.get("left", 1.0) > 0.5  # (absent: not training yet)
    assert waited > 2.5  # (the round's close: --wait, 5 s, since this peer's parts never come)


def test_reference_replicas_train_diloco_style_beside_a_block_and_a_joiner_gets_their_state(swarm, tmp_path):
    """DiLoCo mode: replicas of the whole end-to-end reference average int4 changes with error
    feedback and a Nesterov outer step through the same rounds as a block's replicas; a block node in
    the same swarm is not taken for one of them; a joiner fetches their exact state."""
    flags = ["--every", "5", "--wait", "2", "--n-blocks", "2", "--outer", "nesterov", "--codec", "int4",
             "--error-feedback", "--lz4"]
    d1 = swarm("d1", "reference", *flags, "--steps", "30")
    d2 = swarm("d2", "reference", *flags, "--steps", "30", seed=d1)
    block = swarm("b0", 0, "--every", "5", "--wait", "2", "--n-blocks", "2", "--steps", "10", seed=d1)
    states = wait_until(lambda: all_done_and_equal([d1, d2]), 180, "the reference's replicas to finish on one state")
    s = states[0]
    assert s["part"] == "reference" and s["counters"]["rounds"] >= 5 and s["counters"]["rejected"] == 0
    assert s["flops_per_step"] > 0 and s["train_flops"] == pytest.approx(30 * s["flops_per_step"])
    memory = s["memory_mb"]
    assert memory["frozen"] == 0 and memory["activations"] > 0 and memory["optimizer"] == pytest.approx(
        2 * memory["weights"]) and memory["total"] == pytest.approx(sum(v for k, v in memory.items() if k != "total"))
    assert s["peak_rss_mb"] > 0 and (tmp_path / "d1-ckpt" / "worker-reference.json").exists()
    b = wait_until(lambda: training(block) if training(block)["done"] else None, 120, "the block node to finish")
    assert b["part"] == "block" and b["params"] != s["params"] and b["version"]["hash"] != s["version"]["hash"]
    assert b["memory_mb"]["frozen"] == 0  # (block 0 reads no earlier block)
    joiner = swarm("j", "reference", *flags, "--steps", "0", seed=d2)
    joined = wait_until(lambda: all_done_and_equal([d1, d2, joiner]), 60, "the joiner to sync")
    assert {t["version"]["hash"] for t in joined} == {s["version"]["hash"]}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_node_stopped_between_rounds_saves_its_steps_and_resumes_at_them(swarm, tmp_path, sig):
    """A node stopped by SIGINT or SIGTERM mid-round lets its current step end, then checkpoints the
    step and its own parameters beside the round's state, and exits 0: restarted, it resumes at that
    very step with those parameters (it lost the steps since its last round before, as a node
    stopped at step 63 resumed at 60), still in the round it was in."""
    out = tmp_path / "a-ckpt"
    node = swarm("a", 0, "--every", "100000", "--wait", "1", "--steps", "1000000")
    wait_until(lambda: training(node)["step"] >= 5, 60, "a few steps")
    node.kill(sig)
    assert node.proc.returncode == 0
    first = checkpoint.load(out, "worker-0")
    step, local = first.state["step"], first.tensors["local"]
    assert step >= 5 and first.state["version"]["round"] == 0 and first.state["since"] == 0
    assert not torch.equal(local, first.tensors["params"])  # (its steps since the round's state, kept beside it)
    assert f"stopped at step {step}: saved to" in node.log.read_text()
    node.start()
    wait_until(lambda: training(node)["step"] > step, 60, "the restarted node to train on")
    resumed = re.findall(r"resumed from .*: round 0, step (\d+), loss (\S+), state \w+, its own parameters (\w+) "
                         r"\((\d+) steps since", node.log.read_text())
    assert len(resumed) == 1 and resumed[0] == (str(step), f"{first.state['loss']:.4f}", state_hash(local)[:12],
                                                str(step)), resumed
    node.kill(sig)  # and again: its round still started at step 0
    assert node.proc.returncode == 0
    second = checkpoint.load(out, "worker-0")
    assert second.state["step"] > step and second.state["since"] == 0 and second.state["version"]["round"] == 0
