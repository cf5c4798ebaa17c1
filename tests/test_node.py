"""Real nodes as separate processes on 127.0.0.1: handshake, auth, bad input, fuzz, membership."""

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spheroid.config import NodeConfig
from spheroid.node.accounting import Traffic
from spheroid.node.connection import Connection, PeerGone, PeerRefused, dial
from spheroid.node.identity import load_or_create
from spheroid.node.node import Node, PeerInfo
from spheroid.node.tls import TlsFailed
from spheroid.wire import VERSION, ProtocolError, encode
from spheroid.wire.messages import Message, Peers, PeersReply, Status
from spheroid.wire.session import Session

from .nodes import (
    NodeProcess,
    RawPeer,
    free_port,
    handshake_then,
    hello,
    make_certs,
    raw_exchange,
    stop_all,
    wait_until,
)
from .test_wire import MALFORMED

VECTORS = Path(__file__).resolve().parents[1] / "proto" / "vectors"


@pytest.fixture
def node(tmp_path):
    n = NodeProcess(tmp_path, "solo").start()
    n.wait_ready()
    yield n
    n.stop()


def test_status_reports_identity_and_counters(node):
    first = node.status()
    assert len(first["node"]) == 32 and first["swarm"] == "spheroid" and first["version"] == VERSION
    assert first["peers"] == [] and first["authenticated"] is False
    second = node.status()
    received = second["traffic_by_type"]["received"]
    assert received["status"]["frames"] >= 1 and received["hello"]["frames"] >= 2
    assert second["traffic"]["sent"]["wire_bytes"] > 0


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_input_gets_an_error_and_a_close_and_the_node_keeps_serving(node, name):
    data, code = MALFORMED[name]
    got = handshake_then(node.addr, data)
    assert [m["t"] for m in got] == ["hello", "error"] and got[-1]["code"] == code
    assert node.status()["node"]


def test_truncated_frame_then_close_leaves_the_node_serving(node):
    frame = encode({"t": "status", "id": 2})
    handshake_then(node.addr, frame[:-3])  # we close with the frame incomplete
    assert node.status()["node"]


@pytest.mark.parametrize("change, code", [({"version": 1}, "version"), ({"swarm": "other"}, "swarm"),
                                          ({"auth": True}, "auth_required"), ({"node": "me"}, "handshake"),
                                          ({"nonce": b"short"}, "handshake")])
def test_handshake_mismatch_is_refused_with_a_clear_error(node, change, code):
    got = raw_exchange(node.addr, [encode(hello(**change))])
    assert got[-1]["t"] == "error" and got[-1]["code"] == code
    assert node.status()["node"]


def test_any_message_before_hello_is_refused(node):
    got = raw_exchange(node.addr, [encode({"t": "status", "id": 1})])
    assert got[-1]["code"] == "handshake" and not any(m["t"] == "status_reply" for m in got)


def test_wrong_secret_is_rejected_before_any_other_message(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("correct horse battery staple\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("incorrect pony\n")
    n = NodeProcess(tmp_path, "locked", "--secret-file", str(secret)).start()
    try:
        n.wait_ready(secret=b"correct horse battery staple")
        # a raw client with the wrong MAC, then a status request in the same breath
        got = raw_exchange(n.addr, [encode(hello(auth=True)), encode({"t": "auth", "id": 2, "mac": b"\0" * 32}),
                                    encode({"t": "status", "id": 3})])
        # version 2: the node proves nothing to a peer that has not proven first
        assert [m["t"] for m in got] == ["hello", "error"] and got[-1]["code"] == "auth_failed"
        with pytest.raises((PeerGone, ProtocolError), match="auth"):  # either side may notice first
            n.status(secret=b"incorrect pony")
        with pytest.raises((PeerGone, ProtocolError), match="secret"):
            n.status()
        out = subprocess.run([sys.executable, "-m", "spheroid", "status", "--peer", n.addr, "--secret-file",
                              str(wrong)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "auth" in out.stderr and "Traceback" not in out.stderr
        status = n.status(secret=b"correct horse battery staple")
        # answered before this one: only the readiness probe, never the status sent with the wrong MAC
        assert status["authenticated"] and status["traffic_by_type"]["sent"]["status_reply"]["frames"] == 1
    finally:
        assert n.stop() == 0


def test_a_secret_mistake_is_named_on_both_sides(tmp_path):
    """A client without the swarm's secret, or with another, is told which and what to give; the node logs
    the cause and the client's address."""
    (tmp_path / "secret").write_text("the swarm's secret\n")
    n = NodeProcess(tmp_path, "locked", "--secret-file", str(tmp_path / "secret")).start()
    try:
        n.wait_ready(secret=b"the swarm's secret")
        with pytest.raises((PeerGone, ProtocolError)) as err:
            n.status()
        assert str(err.value) == (f"the node at {n.addr} has a swarm secret and this client has none (auth_required): "
                                  "give this client --secret-file with the swarm's secret")
        with pytest.raises(PeerRefused) as err:
            n.status(secret=b"another secret")
        assert str(err.value) == (f"the node at {n.addr} refused this client's swarm secret (auth_failed): "
                                  "--secret-file does not hold the swarm's secret")
    finally:
        assert n.stop() == 0
    log = n.log.read_text()
    assert "refused 127.0.0.1:" in log
    assert ": this node has a swarm secret (--secret-file) and the peer has none (auth_required)" in log
    assert ": the peer failed to prove the swarm secret (auth_failed): its --secret-file holds another secret" in log


def test_a_tls_mistake_is_named_on_both_sides(tmp_path):
    """Against a node with TLS and a swarm CA: a client without TLS, one whose certificate the CA did not sign,
    and one whose CA did not sign the node's; and a client with TLS against a node without. Each client's error
    names the cause and the flag to give, and the node that refused logs the cause and the client's address
    (asyncio's TLS would have dropped each without a word: "? closed the connection")."""
    pem = make_certs(tmp_path)
    tls = {"tls_cert": str(pem["cert"]), "tls_key": str(pem["key"]), "tls_ca": str(pem["ca"])}
    t = NodeProcess(tmp_path, "t", *(arg for key, path in tls.items() for arg in (f"--{key.replace('_', '-')}", path)))
    plain = NodeProcess(tmp_path, "plain")
    t.start()
    plain.start()
    try:
        assert t.wait_ready(cfg=tls)["tls"]
        plain.wait_ready()
        with pytest.raises(PeerRefused) as err:
            t.status()
        assert str(err.value) == (f"the node at {t.addr} speaks TLS and this client does not (tls_required): give "
                                  "--tls-cert and --tls-key (and the swarm's CA as --tls-ca)")
        with pytest.raises((PeerGone, TlsFailed), match="refused this side's certificate.*--tls-ca"):
            t.status(cfg={**tls, "tls_cert": str(pem["rogue"]), "tls_key": str(pem["rogue_key"])})
        with pytest.raises(TlsFailed, match=f"TLS with {t.addr} failed: its certificate is not signed by this "
                                            "side's --tls-ca"):
            t.status(cfg={**tls, "tls_ca": str(pem["rogue"])})
        with pytest.raises(TlsFailed, match=f"TLS with {plain.addr} failed: it does not speak TLS: give both sides "
                                            "--tls-cert and --tls-key"):
            plain.status(cfg=tls)
        assert t.status(cfg=tls)["tls"]  # (and the node serves on)
    finally:
        assert stop_all([t, plain]) == [0, 0]
    log = t.log.read_text()
    refused = [line.split("refused 127.0.0.1:", 1)[1] for line in log.splitlines() if "refused 127.0.0.1:" in line]
    causes = [line.split(": ", 1)[1] for line in refused]
    assert causes[0] == ("it does not speak TLS and this node does (it needs --tls-cert and --tls-key, and the "
                         "swarm's CA as --tls-ca)")
    assert causes[1].startswith("its certificate is not signed by this node's --tls-ca")
    assert "refused this node's certificate" in causes[2] and len(causes) == 3
    assert "refused 127.0.0.1:" in plain.log.read_text() and "the peer speaks TLS and this side does not" in (
        plain.log.read_text())


def test_a_reply_to_no_request_of_the_nodes_is_refused_and_one_to_its_request_taken(node):
    """PROTOCOL.md, section 2: a reply whose `re` names no outstanding request of the receiver's is
    `unexpected`. A peer answers the node's own `peers` request (kept), then answers it again (refused)."""
    got = handshake_then(node.addr, encode({"t": "status_reply", "id": 2, "re": 77, "status": {}}))
    assert [m["t"] for m in got] == ["hello", "error"] and got[-1]["code"] == "unexpected"
    peer = RawPeer(node.addr)
    try:
        peer.send(hello(role="worker", node="ab" * 16))
        assert peer.receive()[0]["t"] == "hello"
        while (asked := peer.receive()[0])["t"] != "peers":  # (the node gossips with a peer that joins)
            pass
        peer.send({"t": "peers_reply", "id": 2, "re": asked["id"], "peers": []})
        peer.send({"t": "status", "id": 3})
        while (reply := peer.receive()[0])["t"] == "peers":
            pass
        assert reply["t"] == "status_reply" and reply["re"] == 3  # the answer was taken: still open
        peer.send({"t": "peers_reply", "id": 4, "re": asked["id"], "peers": []})
        while (refusal := peer.receive()[0])["t"] != "error":
            pass
        assert refusal["code"] == "unexpected" and "no request" in refusal["message"]
    finally:
        peer.close()
    assert node.status()["node"]


def test_fuzz_ten_thousand_random_and_mutated_frames(node):
    rng = random.Random(1234)
    valid = [bytes.fromhex(json.loads(p.read_text())["frame"]) for p in VECTORS.glob("*.json")]

    def fuzz_frame() -> bytes:
        if rng.random() < 0.4:
            body = rng.randbytes(rng.randint(0, 64))
            return len(body).to_bytes(4, "big") + body
        f = bytearray(rng.choice(valid))
        for _ in range(rng.randint(1, 4)):
            op, pos = rng.random(), rng.randrange(len(f))
            if op < 0.6:
                f[pos] = rng.randrange(256)
            elif op < 0.8:
                del f[pos]
            else:
                f.insert(pos, rng.randrange(256))
        return bytes(f)

    async def blast() -> int:
        host, port = node.addr.split(":")
        sent, deadline = 0, time.monotonic() + 120
        while sent < 10_000 and time.monotonic() < deadline:
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                await asyncio.sleep(0.05)
                continue
            frames = [fuzz_frame() for _ in range(8)]
            try:
                writer.write(encode(hello()) if rng.random() < 0.5 else b"")
                for f in frames:
                    writer.write(f)
                    sent += 1
                await asyncio.wait_for(writer.drain(), 5)
                await asyncio.wait_for(reader.read(1 << 16), 5)
            except (OSError, TimeoutError):
                pass
            writer.close()
        return sent

    sent = asyncio.run(blast())
    assert sent >= 10_000
    assert node.status()["node"]  # still serving, still answering


def test_five_nodes_from_one_seed_reach_full_membership_and_survive_a_kill(tmp_path):
    seed = NodeProcess(tmp_path, "n0").start()
    nodes = [seed] + [NodeProcess(tmp_path, f"n{i}", "--peer", seed.addr).start() for i in range(1, 5)]
    try:
        ids = {n.addr: n.wait_ready()["node"] for n in nodes}

        def peers_of(n: NodeProcess) -> set[str]:
            return {p["node"] for p in n.status()["peers"]}

        def full(group):
            return all(peers_of(n) == {ids[m.addr] for m in group if m is not n} for n in group)

        wait_until(lambda: full(nodes), 60, "full membership of 5 nodes")
        victim = nodes[3]
        victim.kill(signal.SIGKILL)
        rest = [n for n in nodes if n is not victim]
        wait_until(lambda: full(rest), 60, "the killed node to be dropped by the other four")
        victim.start()  # same identity file, same address
        assert victim.wait_ready()["node"] == ids[victim.addr]
        wait_until(lambda: full(nodes), 90, "the restarted node to be re-admitted by all")
    finally:
        codes = stop_all(nodes)
    assert all(code == 0 for code in codes), codes


def test_identity_is_persistent_and_exclusive(tmp_path):
    a = NodeProcess(tmp_path, "same").start()
    try:
        first = a.wait_ready()["node"]
        twin = NodeProcess(tmp_path, "same")  # same identity file, another port
        out = subprocess.run([sys.executable, "-m", "spheroid", "node", "--listen", twin.addr, "--identity",
                              str(twin.identity)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "in use by another running node" in out.stderr
        # on the network: a second node claiming a connected node's id from another address is refused
        b = NodeProcess(tmp_path, "other", "--peer", a.addr).start()
        b_id = b.wait_ready()["node"]
        wait_until(lambda: any(p["node"] == b_id for p in a.status()["peers"]), 30, "b to join a")
        got = raw_exchange(a.addr, [encode(hello(node=b_id, addr="127.0.0.1:1", role="worker"))])
        assert got[-1]["code"] == "duplicate_identity"
        assert b.stop() == 0
    finally:
        assert a.stop() == 0
    state = json.loads(Path(f"{a.identity}.peers.json").read_text())
    assert state["node"] == first
    a.start()
    try:
        assert a.wait_ready()["node"] == first
    finally:
        a.stop()


def test_tls_with_a_swarm_ca_and_announce(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=spheroid-test"], check=True, capture_output=True)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(cert)]
    cfg = {"tls_cert": str(cert), "tls_key": str(key), "tls_ca": str(cert)}
    a = NodeProcess(tmp_path, "a", *tls).start()
    b = NodeProcess(tmp_path, "b", *tls, "--peer", a.addr)
    b.args = (*b.args, "--announce", b.addr)  # announce what it listens on: peers must dial exactly this
    b.start()
    try:
        assert a.wait_ready(cfg=cfg)["tls"]
        b.wait_ready(cfg=cfg)
        wait_until(lambda: [p["addr"] for p in a.status(cfg=cfg)["peers"]] == [b.addr], 30, "b to join a over TLS")
        with pytest.raises((PeerGone, ProtocolError, OSError, TimeoutError)):
            a.status()  # no TLS: refused (closed, or TLS bytes that are no frame)
    finally:
        assert a.stop() == 0 and b.stop() == 0


def test_sigint_stops_cleanly_and_writes_the_peer_table(tmp_path):
    a = NodeProcess(tmp_path, "a").start()
    b = NodeProcess(tmp_path, "b", "--peer", a.addr).start()
    try:
        b_id = b.wait_ready()["node"]
        wait_until(lambda: a.status()["peers"], 30, "b to join a")
    finally:
        a.kill(signal.SIGINT)
        b.stop()
    assert a.proc.returncode == 0
    state = json.loads(Path(f"{a.identity}.peers.json").read_text())
    assert [p["node"] for p in state["peers"]] == [b_id]


def test_gossip_survives_a_peer_that_advertises_garbage(tmp_path):
    """An in-process node gossips with a peer whose peer list is junk: it ignores it and carries on."""

    async def scenario() -> dict:
        cfg = NodeConfig(listen=f"127.0.0.1:{free_port()}", identity=str(tmp_path / "n.json"))
        node = Node(cfg, load_or_create(cfg.identity))
        await node.start()
        me = {"node": "ab" * 16, "addr": "127.0.0.1:1", "role": "worker", "blocks": [], "boot": b"12345678"}
        session = Session(me, dialler=True, swarm=cfg.swarm, secret=None)
        liar = await dial("127.0.0.1", int(cfg.listen.split(":")[1]), Traffic(), session, 10.0)
        await liar.open()
        junk = [{"node": "cd" * 16, "addr": "not an address", "role": "worker", "blocks": []},
                {"node": "zz", "addr": "127.0.0.1:2", "role": "worker", "blocks": []}]

        async def answer(conn: Connection, msg: Message) -> None:
            if isinstance(msg, Peers):
                await conn.send(PeersReply(re=msg.id, peers=junk))

        serving = asyncio.create_task(liar.serve(answer, 30))
        await asyncio.sleep(0.2)
        await node.gossip_once()
        status = node.status()
        await liar.close()
        await serving
        await node.stop()
        return status

    status = asyncio.run(scenario())
    assert [p["node"] for p in status["peers"]] == ["ab" * 16] and status["known"] == 1


def test_a_quiet_client_that_answers_pings_is_never_cut_off(node):
    """The keepalive rule (PROTOCOL.md, section 5): a client that sends nothing of its own for longer
    than the node's 8 s silence limit, as while waiting on a long generate, stays connected because
    it answers the node's pings."""
    from spheroid.node.client import connect

    async def scenario() -> dict:
        conn = await connect(node.addr, NodeConfig(role="client", timeout=5))
        try:
            await asyncio.sleep(12)
            assert not conn.closed
            return (await conn.request(Status())).status
        finally:
            await conn.close()

    assert asyncio.run(scenario())["node"]


def test_gossip_slows_down_while_membership_is_settled_and_speeds_up_when_it_changes(tmp_path):
    """On a settled swarm peer lists are asked for less and less often (they were most of the bytes of
    a swarm that averages rarely); a peer leaving brings the interval back at once."""

    async def main() -> None:
        ports = [free_port() for _ in range(3)]
        nodes = []
        for i, port in enumerate(ports):
            cfg = NodeConfig(listen=f"127.0.0.1:{port}", peers=(f"127.0.0.1:{ports[0]}",) if i else (),
                             identity=str(tmp_path / f"n{i}.json"), gossip_interval=0.2, gossip_max=1.6)
            nodes.append(Node(cfg, load_or_create(cfg.identity)))
            await nodes[-1].start()
        seed = nodes[0]

        def asked() -> int:
            return seed.traffic.by_type()["sent"].get("peers", {}).get("frames", 0)

        try:
            while any(len(n.conns) < 2 for n in nodes):  # the full mesh
                await asyncio.sleep(0.05)
            await asyncio.sleep(4.0)  # settled: intervals 0.2, 0.4, 0.8, 1.6, 1.6 ...
            before = asked()
            await asyncio.sleep(6.4)
            settled = asked() - before  # at most 5 rounds of 2 requests (32 at 0.2 s apart)
            assert settled <= 10, settled
            before = asked()
            await nodes.pop().stop()
            await asyncio.sleep(1.0)  # the loss wakes gossip: a round within 0.2 s of it, then 0.2 s apart
            assert asked() - before >= 2
        finally:
            for n in nodes:
                await n.stop()

    asyncio.run(main())


async def a_hub_and_two_nodes_that_know_each_other(tmp_path, **settings) -> tuple[Node, Node, Node]:
    """hub, a and c, each keeping at most one connection: a and c dial the hub, and a learns of c."""
    def config(name: str, *peers: str) -> NodeConfig:
        return NodeConfig(listen=f"127.0.0.1:{free_port()}", identity=str(tmp_path / f"{name}.json"),
                          peers=peers, max_peers=1, **settings)

    hub = Node(config("hub"), load_or_create(str(tmp_path / "hub.json")))
    await hub.start()
    a = Node(config("a", hub.cfg.listen), load_or_create(str(tmp_path / "a.json")))
    c = Node(config("c", hub.cfg.listen), load_or_create(str(tmp_path / "c.json")))
    await a.start()
    await c.start()
    for _ in range(100):
        await a.gossip_once()
        if c.id in a.known:
            break
        await asyncio.sleep(0.1)
    return hub, a, c


def test_a_node_reaches_a_peer_it_knows_from_gossip_but_is_not_connected_to(tmp_path):
    """A large averaging group needs peers beyond a node's standing connections: `reach` dials them
    at the address gossip gave (once, however many sends wait), and says None for a stranger."""

    async def scenario() -> tuple:
        hub, a, c = await a_hub_and_two_nodes_that_know_each_other(tmp_path)
        try:
            before = c.id in a.conns
            conns = await asyncio.gather(a.reach(c.id), a.reach(c.id))
            return before, [x.label if x else None for x in conns], await a.reach("ef" * 16), c.id
        finally:
            for n in (a, c, hub):
                await n.stop()

    before, labels, stranger, c = asyncio.run(scenario())
    assert not before and labels == [c, c] and stranger is None


def test_a_reached_connection_is_closed_once_idle_while_over_max_peers_and_reached_again(tmp_path):
    """Averaging in a large group reaches new peers every round: a connection reach() dialled is
    closed once it carried nothing but pings for reach_idle while the node is over max_peers (so its
    connections stay bounded), and reach dials the peer again when it is needed again; a peer the
    averager keeps (its row and column) stays connected however long it is idle."""

    async def scenario() -> tuple:
        hub, a, c = await a_hub_and_two_nodes_that_know_each_other(tmp_path, ping_interval=0.2, reach_idle=2.0)
        try:
            first = await a.reach(c.id)
            reached = sorted(a.conns) == sorted([hub.id, c.id])
            await asyncio.sleep(0.3)
            kept_while_fresh = not first.closed  # (pings alone for 0.3 s: not idle yet)
            for _ in range(150):  # idle after 2 s of pings only, checked every 0.2 s
                if first.closed and c.id not in a.conns and a.id not in c.conns:
                    break
                await asyncio.sleep(0.1)
            closed = first.closed and list(a.conns) == [hub.id]
            again = await a.reach(c.id)
            reached_again = again is not None and again is not first and not again.closed
            a.keep.append(lambda: {c.id})  # (the averager's partners: its row and column)
            await asyncio.sleep(3.0)
            return reached, kept_while_fresh, closed, reached_again, not again.closed
        finally:
            for n in (a, c, hub):
                await n.stop()

    assert asyncio.run(scenario()) == (True, True, True, True, True)


def test_the_side_that_dialled_pings_and_a_settled_full_mesh_asks_two_peers_for_peer_lists(tmp_path):
    """Keepalives and peer lists were a third of what a settled swarm that averages rarely moved:
    the acceptor of a connection answers pings instead of sending its own (but for its RTT, now and
    then), and a node connected to every peer it knows asks only two of them once settled."""

    async def main() -> tuple:
        ports = [free_port() for _ in range(4)]
        nodes = []
        for i, port in enumerate(ports):
            cfg = NodeConfig(listen=f"127.0.0.1:{port}", peers=(f"127.0.0.1:{ports[0]}",) if i else (),
                             identity=str(tmp_path / f"n{i}.json"), ping_interval=0.5)
            nodes.append(Node(cfg, load_or_create(cfg.identity)))
            await nodes[-1].start()
        try:
            while any(len(n.conns) < 3 for n in nodes):  # the full mesh
                await asyncio.sleep(0.05)
            seed, joiner = nodes[0], nodes[1]
            if not joiner.conns[seed.id].outbound:  # (it dialled the seed, unless the seed won a mutual dial)
                seed, joiner = joiner, seed

            def pings(a: Node, b: Node) -> int:
                return a.traffic.by_type(b.id)["sent"].get("ping", {}).get("frames", 0)

            before = pings(joiner, seed), pings(seed, joiner)
            await asyncio.sleep(5.0)
            dialler, acceptor = pings(joiner, seed) - before[0], pings(seed, joiner) - before[1]

            seed = nodes[0]

            def asked() -> int:
                return seed.traffic.by_type()["sent"].get("peers", {}).get("frames", 0)

            counts = []
            for everyone in (True, False):
                start = asked()
                await seed.gossip_once(everyone=everyone)
                counts.append(asked() - start)
            seed.known["ab" * 16] = PeerInfo("ab" * 16, "127.0.0.1:9", "worker", [0], [])  # not connected
            start = asked()
            await seed.gossip_once(everyone=False)
            counts.append(asked() - start)
            return dialler, acceptor, counts
        finally:
            for n in nodes:
                await n.stop()

    dialler, acceptor, counts = asyncio.run(main())
    assert dialler >= 5 and acceptor <= dialler // 3, (dialler, acceptor)  # (about 10 against 0 or 1)
    assert counts == [3, 2, 3]  # all, two once settled, all while a known peer is not connected
