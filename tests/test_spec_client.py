"""A client written from proto/PROTOCOL.md alone: plain sockets, msgpack and hmac, none of spheroid.

It connects to a real node that has a swarm secret, authenticates (section 6, version 2) and asks for the
node's status (section 2). If this passes, the spec says enough to do that.
"""

import hashlib
import hmac
import os
import socket
import struct

import msgpack

from .nodes import NodeProcess


def send(sock: socket.socket, message: dict) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    sock.sendall(struct.pack(">I", len(body)) + body)
    return body


def receive(sock: socket.socket) -> tuple[dict, bytes]:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "the node closed the connection"
            data += chunk
        return data

    (length,) = struct.unpack(">I", exactly(4))
    assert 0 < length <= 4 << 20
    body = exactly(length)
    return msgpack.unpackb(body, raw=False), body


def test_a_client_from_the_spec_authenticates_and_reads_the_status(tmp_path):
    secret = b"a swarm secret"
    (tmp_path / "secret").write_bytes(secret + b"\n")
    node = NodeProcess(tmp_path, "spec", "--swarm", "specswarm", "--secret-file", str(tmp_path / "secret")).start()
    try:
        node.wait_ready(cfg={"swarm": "specswarm"}, secret=secret)
        host, port = node.addr.split(":")
        me, nonce = os.urandom(16).hex(), os.urandom(16)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            mine = send(sock, {"t": "hello", "id": 1, "version": 11, "swarm": "specswarm", "node": me, "addr": "",
                               "role": "client", "blocks": [], "nonce": nonce, "auth": True,
                               "boot": os.urandom(8)})
            theirs, their_body = receive(sock)
            assert theirs["t"] == "hello" and theirs["auth"] is True
            # section 6: the transcript binds both hellos' bodies; we dialled, so ours comes first
            digest = hashlib.sha256(b"spheroid-handshake-v2")
            for body in (mine, their_body):
                digest.update(struct.pack(">I", len(body)) + body)
            th = digest.digest()
            mac = hmac.new(secret, b"spheroid-handshake-v2|dialler|" + th, hashlib.sha256).digest()
            send(sock, {"t": "auth", "id": 2, "mac": mac})
            proof, _ = receive(sock)
            expected = hmac.new(secret, b"spheroid-handshake-v2|acceptor|" + th, hashlib.sha256).digest()
            assert proof["t"] == "auth" and hmac.compare_digest(proof["mac"], expected)
            send(sock, {"t": "status", "id": 3})
            reply, _ = receive(sock)
            while reply["t"] == "ping":  # a node pings; a client that waits long must answer (section 5)
                reply, _ = receive(sock)
        assert reply["t"] == "status_reply" and reply["re"] == 3
        assert reply["status"]["node"] == theirs["node"] and reply["status"]["authenticated"] is True
    finally:
        assert node.stop() == 0
