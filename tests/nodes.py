"""Helpers to run real nodes as separate processes through the CLI, and to talk to them raw."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack

from spheroid.config import NodeConfig
from spheroid.launch import free_port
from spheroid.node.client import fetch_status
from spheroid.wire import VERSION, Decoder, encode


class NodeProcess:
    """`spheroid node` in its own process, reaped by stop() (tests call it in a finally/fixture)."""

    def __init__(self, folder: Path, name: str, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.identity = folder / f"{name}.json"
        self.log = folder / f"{name}.log"
        self.args = args
        self.proc: subprocess.Popen | None = None

    def start(self) -> NodeProcess:
        cmd = [sys.executable, "-m", "spheroid", "node", "--listen", self.addr, "--identity", str(self.identity),
               "--status-interval", "1", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "a"), stderr=subprocess.STDOUT)
        return self

    def status(self, **kwargs) -> dict:
        return asyncio.run(fetch_status(self.addr, NodeConfig(role="client", timeout=5, **kwargs.pop("cfg", {})),
                                        **kwargs))

    def wait_ready(self, timeout: float = 30.0, **kwargs) -> dict:
        return wait_until(lambda: self.status(**kwargs), timeout, f"node {self.addr} to answer status")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=20)

    def stop(self) -> int | None:
        return stop_all([self])[0]


def stop_all(nodes: list[NodeProcess]) -> list[int | None]:
    """SIGTERM to every node still running, then reap each (SIGKILL after 20 s): their exit codes.
    All at once, as a node spends about half a second of CPU exiting (the interpreter's teardown)."""
    running = [n.proc for n in nodes if n.proc is not None and n.proc.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    for proc in running:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [None if n.proc is None else n.proc.returncode for n in nodes]


def wait_until(check: Callable, timeout: float, what: str, interval: float = 0.3):
    """Poll check() until it returns a truthy value (exceptions count as not yet)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
            last = value
        except Exception as exc:  # noqa: BLE001 - anything means "not yet"
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def make_certs(folder: Path) -> dict[str, Path]:
    """A swarm's CA, a certificate it signed (and its key), and a self-signed one it did not sign, as PEM
    files in folder: {"ca", "cert", "key", "rogue", "rogue_key"}."""
    files = {name: folder / f"{name}.pem" for name in ("ca", "ca_key", "cert", "key", "csr", "rogue", "rogue_key")}

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    for cert, key, name in (("ca", "ca_key", "swarm-ca"), ("rogue", "rogue_key", "rogue")):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(files[key]), "-out", str(files[cert]),
                "-days", "1", "-subj", f"/CN={name}")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(files["key"]), "-out", str(files["csr"]),
            "-subj", "/CN=member")
    openssl("x509", "-req", "-in", str(files["csr"]), "-CA", str(files["ca"]), "-CAkey", str(files["ca_key"]),
            "-CAcreateserial", "-out", str(files["cert"]), "-days", "1")
    return files


def hello(**fields) -> dict:
    base = {"t": "hello", "id": 1, "version": VERSION, "swarm": "spheroid", "node": os.urandom(16).hex(),
            "addr": "", "role": "client", "blocks": [], "nonce": os.urandom(16), "auth": False,
            "boot": os.urandom(8)}
    return {**base, **fields}


def raw_exchange(addr: str, frames: list[bytes], timeout: float = 10.0) -> list[dict]:
    """Send frames on a fresh connection, read until the node closes; the messages it sent back."""
    host, port = addr.split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        for f in frames:
            try:
                sock.sendall(f)
            except OSError:
                break
        decoder, got = Decoder(), []
        while True:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                break
            if not data:
                break
            got += [r.message for r in decoder.feed(data)]
            if got and got[-1]["t"] == "error":
                break
        return got


class RawPeer:
    """A hand-driven connection (to play a client or an attacker): whole frames, blocking, with a timeout."""

    def __init__(self, addr: str | None = None, sock: socket.socket | None = None, timeout: float = 10.0) -> None:
        if sock is None:
            host, port = addr.split(":")
            sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock = sock
        self.sock.settimeout(timeout)

    def send(self, message: dict) -> bytes:
        """Send one message; its frame body (a handshake transcript needs the exact bytes)."""
        body = encode(message)[4:]
        self.send_raw(encode(message))
        return body

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def receive(self) -> tuple[dict, bytes]:
        """The next message other than a ping, and its frame body."""
        while True:
            (length,) = struct.unpack(">I", self._exactly(4))
            body = self._exactly(length)
            message = msgpack.unpackb(body, raw=False)
            if message.get("t") != "ping":
                return message, body

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the peer closed the connection")
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def handshake_then(addr: str, *frames: bytes) -> list[dict]:
    """A valid (secret-less) handshake, then frames; what came back."""
    return raw_exchange(addr, [encode(hello()), *frames])
