"""The handshake of version 2 against an attacker who holds no secret, staged with real nodes.

Each attack is the one that worked against version 1 (or its nearest kin): relaying one member's
proof to another, reflecting a member's proof back to it, replaying a recorded handshake. Each
must end in `auth_failed` (or in no proof at all) with nothing registered on the attacked node.
"""

import asyncio
import os
import socket

import pytest

from spheroid.config import NodeConfig
from spheroid.node.accounting import Traffic
from spheroid.node.connection import dial
from spheroid.node.node import open_session

from .nodes import NodeProcess, RawPeer, hello, wait_until

SECRET = b"the swarm's secret"


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    return path


def start(tmp_path, name, secret_file, *args) -> NodeProcess:
    node = NodeProcess(tmp_path, name, "--secret-file", str(secret_file), *args).start()
    node.wait_ready(secret=SECRET)
    return node


def no_peer_joined(node: NodeProcess) -> None:
    assert node.status(secret=SECRET)["peers"] == []
    assert "joined" not in node.log.read_text()


def test_a_relayed_handshake_gets_no_proof_and_is_refused(tmp_path, secret_file):
    """Version 1's attack: connect to M and N, claim M's id to N, hand each the other's nonce, and
    forward M's proof to N. In version 2 an acceptor proves only after its dialler has, so neither
    M nor N proves anything, and a proof the attacker makes up fails."""
    m, n = start(tmp_path, "m", secret_file), start(tmp_path, "n", secret_file)
    try:
        to_m, to_n = RawPeer(m.addr), RawPeer(n.addr)
        hello_m, _ = to_m.receive()
        hello_n, _ = to_n.receive()
        to_n.send(hello(node=hello_m["node"], nonce=hello_m["nonce"], auth=True, role="worker", addr=m.addr))
        to_m.send(hello(node=hello_n["node"], nonce=hello_n["nonce"], auth=True, role="worker", addr=n.addr))
        for peer in (to_m, to_n):  # neither proves first
            peer.sock.settimeout(2.0)
            with pytest.raises(socket.timeout):
                peer.receive()
            peer.sock.settimeout(10.0)
        to_n.send({"t": "auth", "id": 2, "mac": os.urandom(32)})
        refusal, _ = to_n.receive()
        assert refusal["t"] == "error" and refusal["code"] == "auth_failed"
        no_peer_joined(n)
        no_peer_joined(m)
    finally:
        m.stop()
        n.stop()


def test_a_reflected_proof_is_refused(tmp_path, secret_file):
    """N dials the attacker (a seed it was given); the attacker sends N's own proof back as its own."""
    listener = socket.create_server(("127.0.0.1", 0))
    trap = f"127.0.0.1:{listener.getsockname()[1]}"
    n = start(tmp_path, "n", secret_file, "--peer", trap)
    try:
        listener.settimeout(30)
        sock, _ = listener.accept()
        attacker = RawPeer(sock=sock)
        hello_n, _ = attacker.receive()
        attacker.send(hello(auth=True, role="worker", addr=trap))
        proof, _ = attacker.receive()
        assert proof["t"] == "auth"  # N dialled, so N proves first
        attacker.send({"t": "auth", "id": 2, "mac": proof["mac"]})
        refusal, _ = attacker.receive()
        assert refusal["t"] == "error" and refusal["code"] == "auth_failed"
        no_peer_joined(n)
    finally:
        listener.close()
        n.stop()


def test_a_replayed_handshake_is_refused(tmp_path, secret_file):
    """A genuine client's hello and proof, recorded on the wire and sent again on a new connection."""
    n = start(tmp_path, "n", secret_file)
    recorded = bytearray()

    async def genuine() -> None:
        me = {"node": os.urandom(16).hex(), "addr": "", "role": "client", "blocks": [], "boot": os.urandom(8)}
        host, port = n.addr.split(":")
        conn = await dial(host, int(port), Traffic(), open_session(me, NodeConfig(), SECRET, True, 1 << 20), 10.0)
        write = conn.transport.write
        conn.transport.write = lambda data: (recorded.extend(data), write(data))[1]  # a tap on the wire
        await conn.open()
        await conn.close()

    try:
        asyncio.run(genuine())
        replay = RawPeer(n.addr)
        replay.send_raw(bytes(recorded))
        assert replay.receive()[0]["t"] == "hello"
        refusal, _ = replay.receive()
        assert refusal["t"] == "error" and refusal["code"] == "auth_failed"
        wait_until(lambda: "proof made for another connection" in n.log.read_text(), 10, "the refusal in the log")
    finally:
        n.stop()
