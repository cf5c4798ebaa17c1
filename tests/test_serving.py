"""The inference pipeline: routes, a real 3-node pipeline against local generation, failover, load,
bad requests. Serving nodes are separate processes through the CLI, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import itertools
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from spheroid.config import NodeConfig
from spheroid.decoding import generate, next_traversal
from spheroid.loading import load_chain
from spheroid.node.client import remote_generate, remote_score, score_text
from spheroid.node.connection import PeerGone
from spheroid.node.serving import Batcher
from spheroid.pipeline import Hop, NoRoute, build_route, check_route, parse_blocks, serving_range
from spheroid.wire import encode, stream_frames

from .nodes import NodeProcess, RawPeer, handshake_then, hello, stop_all, wait_until

CLIENT = NodeConfig(role="client", timeout=20)


def test_route_prefers_low_rtt_and_avoids_excluded_nodes():
    servers = [Hop("a", "h:1", 0, 1, 5.0), Hop("b", "h:2", 2, 2, 40.0), Hop("b2", "h:3", 2, 2, 10.0),
               Hop("c", "h:4", 3, 3, 20.0), Hop("all", "h:5", 0, 3, None)]
    assert [h.node for h in build_route(servers, 4)] == ["a", "b2", "c"]
    assert [h.node for h in build_route(servers, 4, exclude={"b2"})] == ["a", "b", "c"]
    assert [h.node for h in build_route(servers, 4, exclude={"c"})] == ["all"]
    with pytest.raises(NoRoute, match="block 2 onwards"):
        build_route(servers, 4, exclude={"b", "b2", "all"})
    check_route([Hop("a", "", 0, 1), Hop("c", "", 2, 3)], 4)
    with pytest.raises(ValueError, match="starts at block 3"):
        check_route([Hop("a", "", 0, 1), Hop("c", "", 3, 3)], 4)
    assert parse_blocks("0-1") == (0, 1) and parse_blocks("2") == (2, 2)
    for bad in ("3-1", "1-", "1_0", "-1", "1--2", " 2", ""):
        with pytest.raises(ValueError):
            parse_blocks(bad)
    assert serving_range([2, 1]) == (1, 2) and serving_range([0, 2]) is None and serving_range([]) is None
    with pytest.raises(ValueError, match="route entry"):
        Hop.from_wire(["a", "h:1", 2, 1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, data_dir):
    """Four tiny blocks of the default model (the relay channel: each block starts from the previous
    block's clean stream, which hops relay), trained for a few steps (what they say does not
    matter; that it is exact does)."""
    folder = tmp_path_factory.mktemp("served")
    for job in (["--block", "all"], ["--reference"]):
        subprocess.run([sys.executable, "-m", "spheroid", "-q", "train", *job, "--steps", "5", "--d-model", "32",
                        "--n-heads", "2", "--layers-per-block", "1", "--context", "32", "--batch", "4",
                        "--data", str(data_dir), "--out", str(folder)],
                       check=True, timeout=120)
    return folder


@pytest.fixture
def servers(tmp_path, model_dir):
    started: list[NodeProcess] = []

    def start(name: str, blocks: str, seed: NodeProcess | None = None, *flags: str) -> NodeProcess:
        args = ["--serve", blocks, "--checkpoint", str(model_dir), *flags]
        if seed is not None:
            args += ["--peer", seed.addr]
        node = NodeProcess(tmp_path, name, *args).start()
        started.append(node)
        return node

    yield start
    stop_all(started)


def pipeline(servers, *flags: str, middle: int = 1) -> tuple[NodeProcess, list[NodeProcess], NodeProcess]:
    head = servers("head", "0-1", None, *flags)
    mids = [servers(f"mid{i}", "2", head, *flags) for i in range(middle)]
    tail = servers("tail", "3", head, *flags)
    every = [head, *mids, tail]
    wait_until(lambda: all(len(n.status()["peers"]) == len(every) - 1 for n in every), 60, "full membership")
    return head, mids, tail


def ask(addr: str, **request) -> dict:
    base = {"prompt": b"The ", "n_bytes": 24, "mode": "sweep", "k": 8, "temperature": 0.8, "seed": 5, "route": []}
    return asyncio.run(remote_generate(addr, CLIENT, {**base, **request}))


def test_three_node_pipeline_gives_the_bytes_of_local_generation(servers, model_dir):
    head, (mid,), tail = pipeline(servers)
    cfg, blocks, codebook = load_chain(model_dir, torch.device("cpu"))
    assert cfg.model.channel == "relay"
    for mode, k, temperature in (("sweep", 8, 0.8), ("sweep", 24, 0.0), ("ar", 1, 0.8)):
        relayed = head.status()["serving"]["relayed_rows"]
        got = ask(mid.addr, mode=mode, k=k, temperature=temperature)  # any serving node coordinates
        local = generate(blocks, cfg.noise, codebook, b"The ", 24, k, temperature, 5)
        assert got["data"] == local, mode
        if mode == "ar":  # the clean stream of the prompt once, then one new position per traversal
            assert head.status()["serving"]["relayed_rows"] - relayed == len(b"The ") + 24 - 1
        assert got["traversals"] == 24 // k and [h[0] for h in got["route"]] == [
            head.status()["node"], mid.status()["node"], tail.status()["node"]]
    text = bytes(range(32, 127)) * 2
    reply = asyncio.run(remote_score(head.addr, CLIENT, {"text": text, "chunk": 1, "seed": 0, "route": []}))
    assert reply["windows"] == 5 and reply["count"] == 5 * 32 and 0 < reply["nll"] / reply["count"] < 10
    # the same text in pieces of two windows (the last of one), three at once: the same windows and noise
    scored: list[int] = []
    split = asyncio.run(score_text(mid.addr, CLIENT, text, 32, {"chunk": 1, "seed": 0, "route": []}, piece=64,
                                   on_scored=scored.append))
    assert (split["windows"], split["count"]) == (5, 5 * 32)
    assert len(scored) == 3 and scored == sorted(scored) and scored[-1] == 160  # bytes scored, as pieces came back
    # (equal here; pieces keyed from offset 0 instead were 3.3e-6 apart, since these blocks are barely trained)
    assert split["nll"] == pytest.approx(reply["nll"], rel=1e-6)
    assert tail.status()["serving"]["hops"] >= 3 + 24 + 5
    assert tail.status()["serving"]["sessions"] >= 1 and tail.status()["serving"]["cache_bytes"] > 0


def test_speculative_decoding_through_the_pipeline_is_ar_in_fewer_traversals(servers, model_dir):
    """Mode spec: at temperature 0 exactly ar's bytes, across window moves (context 32, 70 bytes),
    with drafts kept and refused (each node truncates the session's clean streams, relayed ones
    included, to what stays); at temperature 0.8 the bytes of local speculative generation."""
    head, (mid,), tail = pipeline(servers)
    cfg, blocks, codebook = load_chain(model_dir, torch.device("cpu"))
    prompt = b"The cat sat on the mat. The cat sat on the "
    for n_bytes in (24, 70):
        stats = {}
        expected = generate(blocks, cfg.noise, codebook, prompt, n_bytes, 1, 0.0, 5)
        local = generate(blocks, cfg.noise, codebook, prompt, n_bytes, 1, 0.0, 5, draft=8, stats=stats)
        got = ask(mid.addr, prompt=prompt, n_bytes=n_bytes, mode="spec", k=8, temperature=0.0)
        assert got["data"] == local == expected
        assert got["traversals"] == stats["traversals"] < n_bytes
    got = ask(head.addr, prompt=prompt, n_bytes=40, mode="spec", k=4, temperature=0.8)
    assert got["data"] == generate(blocks, cfg.noise, codebook, prompt, 40, 1, 0.8, 5, draft=4)


def test_sixteen_concurrent_sessions_are_batched_and_give_local_bytes(servers, model_dir):
    """Hops of concurrent sessions run packed into one sequence per layer call (model.Span): each
    session still gets the bytes it gets alone (greedy, so that the packing's float rounding, about
    1e-6, would have to meet a near tie to change a byte), and the nodes ran fewer batches than hops."""
    head, (mid,), tail = pipeline(servers)
    cfg, blocks, codebook = load_chain(model_dir, torch.device("cpu"))
    modes = [("ar", 1), ("spec", 4), ("sweep", 4)]
    requests = [{"prompt": f"session {i} of the test ".encode(), "n_bytes": 10 + i, "mode": modes[i % 3][0],
                 "k": modes[i % 3][1], "temperature": 0.0, "seed": i, "route": []} for i in range(16)]
    before = [n.status()["serving"] for n in (head, mid, tail)]

    async def many() -> list[dict]:
        return await asyncio.gather(*(remote_generate(head.addr, CLIENT, r) for r in requests))

    for r, result in zip(requests, asyncio.run(many()), strict=True):
        chunk, draft = (r["k"], 0) if r["mode"] == "sweep" else (1, r["k"] if r["mode"] == "spec" else 0)
        assert result["data"] == generate(blocks, cfg.noise, codebook, r["prompt"], r["n_bytes"], chunk, 0.0, r["seed"],
                                          draft=draft), r
    after = [n.status()["serving"] for n in (head, mid, tail)]
    hops = [a["hops"] - b["hops"] for a, b in zip(after, before, strict=True)]
    batches = [a["batches"] - b["batches"] for a, b in zip(after, before, strict=True)]
    assert all(b < h for b, h in zip(batches, hops, strict=True)), (batches, hops)


def test_the_batcher_packs_waiting_hops_one_per_session_within_its_limits():
    """Hops that wait while a batch runs make the next batch: one per session (its hops stay in order),
    at most max_hops and max_positions; a refused hop fails alone, a failed batch fails every hop."""
    batches: list[list[str]] = []

    def compute(hops: list[str]) -> list:
        batches.append(hops)
        time.sleep(0.05)  # the batch is running: others queue up
        return [ValueError(f"refused {h}") if h.startswith("bad") else RuntimeError("broken") if h == "boom"
                else h.upper() for h in hops]

    async def main() -> list:
        batcher = Batcher(compute, asyncio.ensure_future, {"batches": 0}, max_hops=3, max_positions=100)
        first = asyncio.ensure_future(batcher.run("a0", "a", 10))  # runs at once, alone
        await asyncio.sleep(0.01)
        rest = [batcher.run(h, h[0], size) for h, size in
                (("a1", 10), ("b0", 10), ("c0", 10), ("d0", 10), ("e0", 95), ("bad", 10))]
        results = await asyncio.gather(first, *rest, return_exceptions=True)
        boom = await asyncio.gather(batcher.run("boom", "x", 1), return_exceptions=True)
        return [*results, *boom, batcher.counters["batches"]]

    *results, boom, count = asyncio.run(main())
    assert results[:6] == ["A0", "A1", "B0", "C0", "D0", "E0"]
    assert isinstance(results[6], ValueError) and isinstance(boom, RuntimeError)
    assert batches[0] == ["a0"] and batches[1] == ["a1", "b0", "c0"]  # three at most
    assert batches[2] == ["d0", "bad"] and batches[3] == ["e0"]  # 95 positions fit in no batch with d0
    assert count == len(batches) == 5


def test_a_dead_middle_hop_is_routed_around_or_fails_clearly(servers):
    head, (mid, spare), tail = pipeline(servers, "--hop-timeout", "3", middle=2)
    ids = {n: n.status()["node"] for n in (head, mid, spare, tail)}
    route = [[ids[head], head.addr, 0, 1], [ids[mid], mid.addr, 2, 2], [ids[tail], tail.addr, 3, 3]]
    killed = []

    def kill_mid_once(_data: bytes) -> None:
        if not killed:
            mid.kill()
            killed.append(time.monotonic())

    result = asyncio.run(remote_generate(head.addr, CLIENT, {
        "prompt": b"x", "n_bytes": 12, "mode": "ar", "k": 1, "temperature": 0.8, "seed": 1, "route": route},
        on_bytes=kill_mid_once))
    assert killed and len(result["data"]) == 12
    assert [h[0] for h in result["route"]] == [ids[head], ids[spare], ids[tail]]  # re-routed, completed
    spare.kill()
    started = time.monotonic()
    with pytest.raises(PeerGone, match="no live serving nodes cover block 2"):
        ask(head.addr)
    assert time.monotonic() - started < 30  # a clear error, never a hang
    assert head.status()["serving"]["blocks"] == [0, 1]  # and the node keeps serving


def test_a_hung_middle_hop_is_routed_around(servers):
    head, (mid, spare), tail = pipeline(servers, "--hop-timeout", "3", middle=2)
    ids = {n: n.status()["node"] for n in (head, mid, spare, tail)}
    route = [[ids[head], head.addr, 0, 1], [ids[mid], mid.addr, 2, 2], [ids[tail], tail.addr, 3, 3]]
    mid.proc.send_signal(signal.SIGSTOP)  # alive, connected, silent
    try:
        started = time.monotonic()
        result = asyncio.run(remote_generate(head.addr, CLIENT, {
            "prompt": b"x", "n_bytes": 8, "mode": "sweep", "k": 8, "temperature": 0.8, "seed": 1, "route": route}))
        assert len(result["data"]) == 8 and [h[0] for h in result["route"]] == [ids[head], ids[spare], ids[tail]]
        assert time.monotonic() - started < 20  # one hop timeout and a ping, not a hang
    finally:
        mid.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("request_fields, code", [
    ({"mode": "beam"}, "mode must be"),
    ({"n_bytes": 10**7}, "bytes to generate"),
    ({"k": 999}, "k must be"),
    ({"route": [["nobody", "127.0.0.1:1", 0, 1]]}, "route covers blocks 0..1"),
    ({"seed": 1 << 63}, "seed must be at most"),
    ({"temperature": float("nan")}, "temperature must be finite"),
])
def test_bad_requests_get_a_clear_error_and_the_nodes_keep_serving(servers, request_fields, code):
    head, _, _ = pipeline(servers, "--hop-timeout", "2")
    with pytest.raises(PeerGone, match=code):
        ask(head.addr, **request_fields)
    assert len(ask(head.addr)["data"]) == 24


def test_malformed_hops_and_oversized_frames_leave_the_pipeline_serving(servers):
    head, _, _ = pipeline(servers)
    bad_hop = {"t": "hop", "id": 7, "session": "s", "traversal": 0, "route": [["x"]], "at": 0, "coordinator": ["y"],
               "model": "m", "ctx": b"ab", "start": 1, "n_noisy": 1, "chunk": 1, "temperature": 0.0, "seed": 0}
    handshake_then(head.addr, encode(bad_hop), encode({"t": "no_such", "id": 8}))
    got = handshake_then(head.addr, b"\xff\xff\xff\xff" + b"x" * 64)  # a frame header claiming 4 GiB
    assert got[-1]["t"] == "error" and got[-1]["code"] == "too_large"
    assert len(ask(head.addr)["data"]) == 24


def test_the_batcher_refuses_hops_beyond_its_queue_as_busy():
    """A peer sending hops faster than they run meets a bound: hops past max_queued are refused (their
    coordinator routes around this node) and the queued ones still run."""
    def compute(hops: list[str]) -> list:
        return [h.upper() for h in hops]

    async def main() -> list:
        batcher = Batcher(compute, asyncio.ensure_future, {"batches": 0}, max_hops=2, max_queued=3)
        batcher.busy = True  # (a batch is running: every hop below waits)
        waiting = [asyncio.ensure_future(batcher.run(f"s{i}", f"s{i}", 1)) for i in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="busy: 3 hops wait"):
            await batcher.run("late", "late", 1)
        batcher.busy = False
        asyncio.ensure_future(batcher._drain())
        return await asyncio.gather(*waiting)

    assert asyncio.run(main()) == ["S0", "S1", "S2"]


def test_a_hop_never_sends_a_known_node_elsewhere_and_never_comes_from_a_client(servers):
    """A hop's route and coordinator carry addresses, but a serving node reaches a node it knows over its
    connection or at the address that node gave: a peer cannot redirect activations or make it
    dial a host of its choosing for a known node. Hops from a client are refused."""
    head = servers("head", "0-1")
    serving = wait_until(lambda: head.status()["serving"], 60, "serving")
    traps = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]  # where the hop says to go
    for trap in traps:
        trap.setblocking(False)
    addrs = [f"127.0.0.1:{t.getsockname()[1]}" for t in traps]
    t = next_traversal(bytearray(b"The "), 1, 1, 0, serving["context"])
    me = hello(role="worker", addr="")
    hop = {"t": "hop", "id": 2, "session": "ab" * 8, "traversal": 0, "at": 0, "model": serving["model"],
           "route": [[head.status()["node"], head.addr, 0, 1], [me["node"], addrs[0], 2, 3]],
           "coordinator": [me["node"], addrs[1], 0, 0], "ctx": t.ctx, "start": t.start, "n_noisy": t.n_noisy,
           "chunk": t.chunk, "temperature": 0.0, "seed": 0}
    peer = RawPeer(head.addr)
    try:
        peer.send(me)
        peer.receive()
        peer.send(hop)
        while (got := peer.receive()[0])["t"] != "hop":  # the next hop comes here, over this connection
            pass
        assert got["at"] == 1 and got["session"] == hop["session"]
        for trap in traps:
            with pytest.raises(BlockingIOError):
                trap.accept()  # nobody dialled there
        refused = handshake_then(head.addr, encode({**hop, "id": 3}))  # a client's hop
        assert refused[-1]["t"] == "error" and refused[-1]["code"] == "unexpected"
        assert head.status()["serving"]["hops"] == 1
    finally:
        peer.close()
        for trap in traps:
            trap.close()


def test_a_route_through_a_node_its_previous_node_has_not_heard_of_yet_works(model_dir, tmp_path):
    """C joins through A (the coordinator) and serves block 3; A routes A -> B -> C at once, while B,
    between two gossips, has not heard of C: B learns C from the hop, as gossip would, and reaches it."""
    from spheroid.launch import free_port
    from spheroid.node.identity import load_or_create
    from spheroid.node.node import Node
    from spheroid.node.serving import BlockServer

    async def scenario() -> tuple[bool, dict, list[str]]:
        nodes = []

        async def start(name: str, first: int, last: int, *seeds: Node, **kw) -> Node:
            cfg = NodeConfig(listen=f"127.0.0.1:{free_port()}", identity=str(tmp_path / f"{name}.json"),
                             peers=tuple(s.cfg.listen for s in seeds), serves=tuple(range(first, last + 1)), **kw)
            node = Node(cfg, load_or_create(cfg.identity))
            BlockServer(node, model_dir, first, last)
            await node.start()
            nodes.append(node)
            return node

        async def joined(node: Node, to: Node) -> None:
            async with asyncio.timeout(30):
                while node.id not in to.conns:
                    await asyncio.sleep(0.02)

        try:
            a = await start("a", 0, 1)
            b = await start("b", 2, 2, a, gossip_interval=60.0, gossip_max=60.0, forget_after=120.0)
            await joined(b, a)
            c = await start("c", 3, 3, a, max_peers=1)  # (it dials no one but its seed)
            await joined(c, a)
            unheard = c.id not in b.known
            got = await remote_generate(a.cfg.listen, CLIENT, {"prompt": b"The ", "n_bytes": 8, "mode": "sweep",
                                                               "k": 8, "temperature": 0.0, "seed": 1, "route": []})
            return unheard, got, [a.id, b.id, c.id]
        finally:
            for node in reversed(nodes):
                await node.stop()

    unheard, got, ids = asyncio.run(scenario())
    assert unheard and len(got["data"]) == 8 and [h[0] for h in got["route"]] == ids


def test_session_cache_is_bounded_and_expires():
    from spheroid.model import KVCache
    from spheroid.node.serving import SessionCache

    cache = SessionCache(max_bytes=3 * 2 * 4 * 8, ttl=60.0)  # room for three sessions of one position

    def one_layer() -> list[KVCache]:
        return [KVCache()]

    for name in "abcd":
        (kv,) = cache.get(name, one_layer).caches
        kv.extend(torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8))
        cache.get(name, one_layer)  # re-checks the budget with the new bytes in
    assert len(cache) == 3 and cache.nbytes <= 3 * 64  # the least recently used went
    cache.ttl = 0.0
    time.sleep(0.01)
    cache.get("e", one_layer)
    assert len(cache) == 1  # the idle ones expired


def test_reference_pipeline_matches_the_reference_run_locally(servers, model_dir):
    """The AR baseline: KV-cached hops give the bytes of full recomputation over the same windows."""
    from spheroid.decoding import sample, traversal_generators, window_start
    from spheroid.loading import load_reference

    head = servers("rhead", "0-1", None, "--serve-reference", "--hop-timeout", "3")
    mid, spare, tail = (servers(name, blocks, head, "--serve-reference", "--hop-timeout", "3")
                        for name, blocks in (("rmid", "2"), ("rspare", "2"), ("rtail", "3")))
    every = (head, mid, spare, tail)
    wait_until(lambda: all(len(n.status()["peers"]) == 3 for n in every), 60, "full membership")
    ids = {n: n.status()["node"] for n in every}
    route = [[ids[head], head.addr, 0, 1], [ids[mid], mid.addr, 2, 2], [ids[tail], tail.addr, 3, 3]]
    cfg, model = load_reference(model_dir, torch.device("cpu"))
    out, context = bytearray(b"The tower "), cfg.model.context
    for traversal in range(40):  # the windows of BlockTrain's ar
        logits = model(torch.tensor(list(out[window_start(len(out), 1, context):]))[None, :])[0, -1:]
        out.extend(sample(logits, 0.8, traversal_generators(5, traversal, torch.device("cpu"))[1]).tolist())
    expected = bytes(out[len(b"The tower "):])
    got = ask(head.addr, mode="ar", k=1, n_bytes=40, prompt=b"The tower ", route=route)  # longer than the window
    assert got["data"] == expected
    assert tail.status()["serving"]["sessions"] >= 1
    # the middle hop dies mid-request: the retry starts a new session on the spare, same bytes
    got = asyncio.run(remote_generate(head.addr, CLIENT, {
        "prompt": b"The tower ", "n_bytes": 40, "mode": "ar", "k": 1, "temperature": 0.8, "seed": 5, "route": route},
        on_bytes=lambda data: mid.kill() if len(data) and mid.proc.poll() is None else None))
    assert got["data"] == expected and got["route"][1][0] == ids[spare]
    with pytest.raises(PeerGone, match="generates in mode ar"):
        ask(head.addr, mode="sweep")


def test_a_node_that_trains_and_serves_keeps_its_rounds_going(servers, model_dir, data_dir):
    node = servers("both", "0-3", None, "--block", "0", "--data", str(data_dir), "--steps", "100000", "--every", "5",
                   "--wait", "1", "--d-model", "32", "--n-heads", "2", "--layers-per-block", "1", "--context", "32",
                   "--batch", "4", "--out", str(model_dir.parent / "both-ckpt"))
    wait_until(lambda: node.status()["training"]["round"] >= 2, 60, "training rounds")
    before = node.status()["training"]["round"]
    got = ask(node.addr, mode="ar", k=1, n_bytes=30)  # a route of one node: itself
    assert len(got["data"]) == 30
    after = node.status()["training"]
    assert after["round"] > before and all(h["waited_s"] <= 1 + 2.0 for h in after["history"])


def test_cli_generate_and_score_through_the_pipeline(servers, model_dir, tmp_path):
    head, (mid,), tail = pipeline(servers)
    ids = [n.status()["node"][:12] for n in (head, mid, tail)]
    gen = subprocess.run([sys.executable, "-m", "spheroid", "generate", "--peer", tail.addr, "--route", ",".join(ids),
                          "--mode", "sweep", "--bytes", "20", "--seed", "2", "--raw", "The "], capture_output=True,
                         timeout=120)
    assert gen.returncode == 0, gen.stderr
    cfg, blocks, codebook = load_chain(model_dir, torch.device("cpu"))
    assert gen.stdout == b"The " + generate(blocks, cfg.noise, codebook, b"The ", 20, 20, 0.8, 2) + b"\n"
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(32, 127)))
    score = subprocess.run([sys.executable, "-m", "spheroid", "score", "--peer", head.addr, str(text)],
                           capture_output=True, text=True, timeout=120)
    assert score.returncode == 0 and "95 bytes; 64 predicted in 2 windows of 32, CE" in score.stdout, score.stderr
    assert "the last 30 bytes were not scored: they do not fill a window of 33 bytes" in score.stdout
    assert f"scoring {text}: 64/64 bytes" in score.stderr  # (progress, as the requests come back)
    text.write_bytes(b"too short")
    short = subprocess.run([sys.executable, "-m", "spheroid", "score", "--peer", head.addr, str(text)],
                           capture_output=True, text=True, timeout=120)
    assert short.returncode == 1 and "has 9 bytes; scoring needs at least a window of 33" in short.stderr
    bad = subprocess.run([sys.executable, "-m", "spheroid", "generate", "--peer", head.addr, "--route", "zzzz", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--route: 'zzzz' names 0 serving nodes" in bad.stderr


def test_one_node_serving_every_block_relays_nothing_and_gives_the_same_bytes(servers, model_dir):
    whole = servers("whole", "0-3")
    wait_until(lambda: whole.status()["serving"]["blocks"] == [0, 3], 60, "the node to serve")
    cfg, blocks, codebook = load_chain(model_dir, torch.device("cpu"))
    got = ask(whole.addr, mode="ar", k=1, temperature=0.8)
    assert got["data"] == generate(blocks, cfg.noise, codebook, b"The ", 24, 1, 0.8, 5)
    assert whole.status()["serving"]["relayed_rows"] == 0


def test_a_clients_requests_at_once_are_capped_and_a_tiny_temperature_samples_the_most_likely_byte(servers):
    """One connection's ninth request at once is refused as busy (one client cannot fill the hop
    queues for everyone); a temperature too small for float32 (1e-300) gives temperature 0's bytes,
    not NaN probabilities that would fail every hop batched with it."""
    whole = servers("whole", "0-3")
    wait_until(lambda: whole.status()["serving"], 60, "the node to serve")
    peer = RawPeer(whole.addr, timeout=60)
    try:
        peer.send(hello(role="client"))
        peer.receive()
        peer.send_raw(b"".join(encode({"t": "score", "id": 10 + i, "text": bytes(range(32, 127)) * 4, "chunk": 1,
                                       "seed": 0, "route": []}) for i in range(9)))  # (at once: one write)
        replies = [peer.receive()[0] for _ in range(9)]
    finally:
        peer.close()
    refused = [r for r in replies if r["t"] == "error"]
    assert [(r["code"], r["re"]) for r in refused] == [("busy", 18)]
    assert sorted(r["re"] for r in replies if r["t"] == "score_reply") == list(range(10, 18))
    assert ask(whole.addr, temperature=1e-300)["data"] == ask(whole.addr, temperature=0.0)["data"]


def test_a_reference_hop_beyond_the_window_is_refused(servers):
    """A peer's hop to a reference node may not grow a session's positions past the context (its KV
    cache and attention would grow with whatever the peer sends)."""
    tail = servers("rtail", "1-3", None, "--serve-reference")
    serving = wait_until(lambda: tail.status()["serving"], 60, "the node to serve")
    context, me = serving["context"], hello(role="worker", addr="")
    ids = itertools.count(100)
    peer = RawPeer(tail.addr)
    try:
        peer.send(me)
        peer.receive()
        for n in (context + 1, 4):  # too many positions, then a hop that fits
            z = torch.randn(1, n, 32)
            peer.send_raw(b"".join(out.frame for out in stream_frames(z, n, lambda: next(ids))))
            peer.send({"t": "hop", "id": next(ids), "session": f"s{n}", "traversal": 0, "at": 1,
                       "model": serving["model"], "route": [[me["node"], "", 0, 0], [tail.status()["node"], tail.addr,
                                                                                     1, 3]],
                       "coordinator": [me["node"], "", 0, 0], "ctx": b"x" * n, "start": 0, "n_noisy": n, "chunk": 1,
                       "temperature": 0.0, "seed": 0, "z": n})
            while (got := peer.receive()[0])["t"] not in ("hop_error", "hop_done"):
                pass
            if n > context:
                assert got["t"] == "hop_error" and f"{n} new positions from position 0 do not fit" in got["message"]
            else:
                assert got["t"] == "hop_done" and len(got["data"]) == 1
    finally:
        peer.close()


def test_a_session_gone_from_a_nodes_cache_starts_over_on_a_new_session(servers, model_dir):
    """A middle node whose cache holds one session, and two generations at once: each evicts the
    other's there, while the node before it still counts on it. A hop that finds its session gone
    makes the coordinator retry the traversal on a new session, not route around the node (here the
    only one serving its blocks): both give the bytes of local generation."""
    head = servers("head", "0-1")
    mid, tail = servers("mid", "2", head, "--cache-mb", "0.0001"), servers("tail", "3", head)
    wait_until(lambda: all(len(n.status()["peers"]) == 2 for n in (head, mid, tail)), 60, "full membership")
    cfg, blocks, codebook = load_chain(model_dir, torch.device("cpu"))

    async def both() -> list[dict]:
        return await asyncio.gather(*(remote_generate(head.addr, CLIENT, {
            "prompt": b"The ", "n_bytes": 24, "mode": "ar", "k": 1, "temperature": 0.8, "seed": seed, "route": []})
            for seed in (1, 2)))

    for seed, got in zip((1, 2), asyncio.run(both()), strict=True):
        assert got["data"] == generate(blocks, cfg.noise, codebook, b"The ", 24, 1, 0.8, seed)
    assert mid.status()["serving"]["failed_hops"] > 0  # (its sessions were evicted)


def test_a_busy_node_that_alone_serves_its_blocks_is_asked_again_not_failed(servers, model_dir):
    """Nodes that let one hop wait (`--max-queued-hops 1`) and eight sessions at once: hops are refused
    as busy, and since no other node serves those blocks, their coordinator asks again after a
    pause rather than failing the request. Every session gets the bytes of local generation."""
    head, (mid,), tail = pipeline(servers, "--max-queued-hops", "1")
    cfg, blocks, codebook = load_chain(model_dir, torch.device("cpu"))
    requests = [{"prompt": f"busy {i} ".encode(), "n_bytes": 12, "mode": "ar", "k": 1, "temperature": 0.0,
                 "seed": i, "route": []} for i in range(8)]

    async def many() -> list[dict]:
        return await asyncio.gather(*(remote_generate(head.addr, CLIENT, r) for r in requests))

    for r, result in zip(requests, asyncio.run(many()), strict=True):
        assert result["data"] == generate(blocks, cfg.noise, codebook, r["prompt"], 12, 1, 0.0, r["seed"]), r
    assert head.status()["serving"]["busy_waits"] > 0
    assert sum(n.status()["serving"]["failed_hops"] for n in (head, mid, tail)) > 0  # (the refusals)
