"""TLS for a node's sockets: the listener that sniffs each accepted socket's first byte, and the words
for what went wrong.

It lives apart from `connection` because none of it touches a `Connection`'s session: `TlsServer`
only hands accepted, TLS-wrapped sockets to the factory it is given (a plain peer is refused in
plain text instead), and `tls_cause` turns OpenSSL's reasons into the flag a user should change.
`connection` uses it for `dial`'s `TlsFailed`, `listen`'s `TlsServer` and the close right after a
TLS handshake that `Connection.open` explains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..progress import QuietLog
from ..wire import encode
from ..wire.messages import Error
from ..wire.session import TLS_RECORD

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger(__name__)
QUIET = QuietLog(log)  # (lines any peer can repeat by connecting again: at most a few a kind per period)


class TlsFailed(ConnectionError):
    """TLS with the peer failed; the text says why and what to do."""


# what OpenSSL calls a peer whose bytes are no TLS record (a spheroid node without TLS sends its hello at once)
NOT_TLS = {"WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE",
           "HTTP_REQUEST", "UNEXPECTED_RECORD"}
# the alerts a peer sends when it refuses the certificate this side showed (or showed none)
CERT_REFUSED = {"TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_BAD_CERTIFICATE", "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
                "TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_HANDSHAKE_FAILURE", "TLSV1_ALERT_DECRYPT_ERROR"}


def tls_cause(exc: BaseException, dialler: bool) -> str:
    """What a failed TLS handshake (or the close right after it) says about its cause, in words that
    name the flag to change. `dialler`: said on the side that dialled (a client, or a node dialling
    a peer), else on the node that accepted."""
    reason = getattr(exc, "reason", None) or ""
    detail = getattr(exc, "verify_message", None) or reason or str(exc) or type(exc).__name__
    if isinstance(exc, ssl.SSLCertVerificationError) or reason == "CERTIFICATE_VERIFY_FAILED":
        return (f"its certificate is not signed by this {'side' if dialler else 'node'}'s --tls-ca ({detail}): "
                "every member needs a certificate signed by the swarm's CA")
    if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
        return "it showed no certificate, and this node's --tls-ca asks for one: give it --tls-cert and --tls-key"
    if reason in CERT_REFUSED:
        return (f"it refused this {'side' if dialler else 'node'}'s certificate ({reason}): it is not signed by "
                "the peer's --tls-ca (give a certificate signed by the swarm's CA)")
    if reason in NOT_TLS:
        return ("it does not speak TLS: give both sides --tls-cert and --tls-key (and the swarm's CA as --tls-ca), "
                "or neither")
    if isinstance(exc, TimeoutError) or "taking longer" in str(exc):
        return f"no TLS handshake in time ({exc})"
    broken_off = isinstance(exc, (ConnectionResetError, BrokenPipeError)) or reason == "UNEXPECTED_EOF_WHILE_READING"
    if broken_off and not dialler:
        return ("it broke off the TLS handshake: most likely it refused this node's certificate, which its --tls-ca "
                "did not sign (give a certificate signed by the swarm's CA)")
    return f"the TLS handshake failed: {detail}"


class TlsServer:
    """A TLS node's listening sockets. Each accepted socket's first byte says whether the peer speaks
    TLS (a TLS handshake record starts with 0x16, a spheroid frame with 0x00): one that does not is
    answered in plain text with an `error` (`tls_required`) that tells its user what to give, and
    closed; one that does goes through the TLS handshake, whose failure is logged with its cause and
    the peer's address (rate-limited). asyncio's own TLS server (create_server(ssl=)) drops both
    without a word on either side."""

    def __init__(self, make: Callable[[], Connection], tls: ssl.SSLContext, timeout: float) -> None:
        self.make, self.tls, self.timeout = make, tls, timeout
        self.sockets: list[socket.socket] = []
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str, port: int, backlog: int) -> None:
        loop = asyncio.get_running_loop()
        for family, kind, proto, _, address in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                      flags=socket.AI_PASSIVE):
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(backlog)
                sock.setblocking(False)
            except OSError:
                sock.close()
                self.close()
                raise
            self.sockets.append(sock)
            self._spawn(self._accept(sock))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for sock in self.sockets:
            sock.close()

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # (out of file descriptors, say: a pause, then on)
                QUIET.log(logging.WARNING, "accept", "cannot accept connections: %s", exc)
                await asyncio.sleep(0.5)
                continue
            self._spawn(self._gate(sock))

    async def _gate(self, sock: socket.socket) -> None:
        """One accepted socket: TLS, or a refusal in plain text; the socket is closed unless a transport took it."""
        loop = asyncio.get_running_loop()
        try:
            host, port = sock.getpeername()[:2]
            remote = f"{host}:{port}"
            first = await asyncio.wait_for(self._first_byte(sock), self.timeout)
            if not first:  # (it closed without a byte)
                sock.close()
            elif first[0] != TLS_RECORD:
                QUIET.log(logging.WARNING, "tls", "refused %s: it does not speak TLS and this node does (it needs "
                          "--tls-cert and --tls-key, and the swarm's CA as --tls-ca)", remote)
                frame = encode(Error(id=1, code="tls_required", message="this node speaks TLS: give --tls-cert and "
                                     "--tls-key (and the swarm's CA as --tls-ca)").to_wire())
                await loop.connect_accepted_socket(lambda: _Refusal(frame), sock)
            else:
                try:
                    await loop.connect_accepted_socket(self.make, sock, ssl=self.tls,
                                                       ssl_handshake_timeout=self.timeout)
                except (OSError, TimeoutError) as exc:  # (ssl.SSLError is an OSError)
                    QUIET.log(logging.WARNING, "tls", "refused %s: %s", remote, tls_cause(exc, dialler=False))
                    sock.close()
        except (OSError, TimeoutError):  # (gone, or silent: nothing to say to it)
            sock.close()
        except BaseException:  # (the server closing: a transport that took the socket closed it already)
            sock.close()
            raise

    @staticmethod
    async def _first_byte(sock: socket.socket) -> bytes:
        """The first byte the peer sent, left in the socket (b"": it closed)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                return sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                pass
            readable = loop.create_future()
            loop.add_reader(sock.fileno(), _settle, readable)
            try:
                await readable
            finally:
                loop.remove_reader(sock.fileno())


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class _Refusal(asyncio.Protocol):
    """Writes a refusal, then reads (and drops) what the peer sends until it closes, or for 2 s: a
    socket closed with unread bytes resets, and the peer could lose the refusal."""

    def __init__(self, frame: bytes) -> None:
        self.frame = frame

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.frame)
        with contextlib.suppress(OSError, NotImplementedError):
            transport.write_eof()
        asyncio.get_running_loop().call_later(2.0, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # (closes)
