"""One TCP connection speaking the protocol: the thin asyncio layer around the sans-I/O session.

A `Connection` is the socket's asyncio protocol. It moves bytes between the socket and a
`wire.Session` (which runs the handshake, checks messages and reassembles streams): the kernel
reads straight into the session's buffer (a `BufferedProtocol`, so a stream chunk's bytes are not
copied on their way to the decoder), and writes go out with backpressure (paused while the
transport's buffer is full, under a timeout). It counts every frame, stops reading while the
messages it has not handed over pile up, times out every wait for the peer, and matches replies
("re") to the requests waiting for them. Heavy tensor encoding runs in a worker thread.

`dial` and `listen` make connections; what TLS adds (the listener that refuses a plain peer in
plain text, the words for a failed TLS handshake) is in `tls`, which knows nothing of a session.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
import time
from collections.abc import Awaitable, Callable

import torch

from ..progress import QuietLog
from ..wire import Encoded, Outgoing, ProtocolError, stream_frames
from ..wire.messages import INLINE, REPLIES, SCHEMAS, STREAM_FIELDS, Error, Hello, Message
from ..wire.session import Arrived, Frame, Opened, Refused, Session
from ..wire.streams import RAW_CHUNK_BYTES
from .accounting import Traffic
from .tls import TlsFailed, TlsServer, tls_cause

log = logging.getLogger(__name__)
LARGE_WAITS = 30  # timeouts a state transfer's reply may take while the peer keeps sending (5 min by default)
QUIET = QuietLog(log)  # (lines any peer can repeat by connecting again: at most a few a kind per period)

Handler = Callable[["Connection", Message], Awaitable[None]]
KEEPALIVE = ("ping", "pong")  # messages that do not count as using a connection
# timeouts without a frame of a stream the peer opened before the connection is closed (a 2 MiB
# chunk at 3 timeouts of 10 s needs 0.6 Mbit/s)
STALLED_TIMEOUTS = 3


class PeerGone(Exception):
    """The peer closed the connection, stopped answering, or refused us."""


class PeerSilent(PeerGone):
    """The peer sent nothing within the timeout."""


class PeerRefused(PeerGone):
    """The peer refused the handshake with an error `code` (`busy`: try again later)."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(text)
        self.code = code


def handshake_failure(exc: BaseException, peer: str, me: str, secret: bool) -> str:
    """Why a handshake failed, in words that name the flag to change, for a swarm secret or TLS
    mistake (`exc`'s own text otherwise). `peer` and `me` name the two sides ("the node at ADDR",
    "this client"); `secret`: whether this side has a swarm secret. `exc` is this side's
    ProtocolError (it refused the peer) or the PeerRefused the peer answered with."""
    code = getattr(exc, "code", None)
    refused_us = isinstance(exc, PeerRefused)
    if code == "auth_required" and secret:
        return (f"{me} has a swarm secret (--secret-file) and {peer} has none (auth_required): both need the "
                "swarm's secret, or neither")
    if code == "auth_required":
        return (f"{peer} has a swarm secret and {me} has none (auth_required): give {me} --secret-file with the "
                "swarm's secret")
    if code == "auth_failed" and refused_us:
        return f"{peer} refused {me}'s swarm secret (auth_failed): --secret-file does not hold the swarm's secret"
    if code == "auth_failed":
        return (f"{peer} failed to prove the swarm secret (auth_failed): its --secret-file holds another secret than "
                f"{me}'s (or it relayed a proof made for another connection)")
    if code == "tls_required" and refused_us:
        return (f"{peer} speaks TLS and {me} does not (tls_required): give --tls-cert and --tls-key (and the "
                "swarm's CA as --tls-ca)")
    return getattr(exc, "message", None) or str(exc)


class Connection(asyncio.BufferedProtocol):
    """Made by `dial` or by a server's protocol factory (`listen`), which call `opened` once the
    socket is connected (after TLS, when there is TLS)."""

    MAX_QUEUED = 64  # events read but not yet taken by `recv` before the socket stops being read

    def __init__(self, traffic: Traffic, session: Session, timeout: float = 10.0,
                 opened: Callable[[Connection], None] | None = None) -> None:
        self.traffic = traffic
        self.timeout = timeout
        self.session = session
        self.label = "?"  # the peer's node id once the handshake is done
        self.host, self.remote = "?", "?:0"
        self.hello: Hello | None = None  # the peer's, once the handshake is done
        self.outbound = session.dialler  # True when this side dialled
        self.dialled: str | None = None  # the address this side dialled (a node's own dials; None: it accepted)
        self.reader_task: asyncio.Task | None = None  # set when something else runs serve() for us
        self.transport: asyncio.Transport | None = None
        self._opened = opened
        self._streams = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._inbox: list[Message] = []
        self._send_lock = asyncio.Lock()
        self._events_in: list = []  # session events not yet taken by `_events`
        self._wakeup: asyncio.Future | None = None  # what `_events` waits on
        self._heard = 0.0  # loop time the peer last sent bytes
        self.said = 0.0  # loop time this side last wrote a frame
        self.used = time.monotonic()  # when it was opened or last carried more than pings
        self._gone: PeerGone | None = None  # why the socket ended, once it has
        self._eof: PeerGone | None = None  # set once the peer has said it sends nothing more
        self._lost = asyncio.get_running_loop().create_future()  # done when the socket is closed
        self._lost_exc: BaseException | None = None  # what closed the socket, if not a clean close
        self._received = 0  # bytes the peer sent
        self._writable = asyncio.Event()  # clear while the transport's write buffer is full
        self._writable.set()
        self._reading_paused = False
        self._streams_moved = (0, 0.0)  # (the session's stream progress, when it last moved): stream_stalled
        self.closed = False

    # --- the socket's callbacks (asyncio.BufferedProtocol) ------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername") or ("?", 0)
        self.host, self.remote = str(peer[0]), f"{peer[0]}:{peer[1]}"
        self._heard = asyncio.get_running_loop().time()
        if self._opened is not None:
            self._opened(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.closed:  # (a TLS transport may still deliver bytes while it shuts down: they are dropped)
            return memoryview(bytearray(1 << 12))
        return self.session.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        self._heard = asyncio.get_running_loop().time()
        self._received += nbytes
        try:
            events = self.session.buffer_updated(nbytes)
        except ProtocolError:  # (kept in session.error: `_events` raises it after what came before)
            events = []
        for event in events:
            # once open, a stream's frames are only counted (the reader need not wake for them); in
            # the handshake every event wakes `open`, which sends this side's next step
            if isinstance(event, Frame) and self.hello is not None:
                self._count(event)
            else:
                self._events_in.append(event)
        if self.session.error is not None or len(self._events_in) >= self.MAX_QUEUED:
            self._pause_reading()
        if self._events_in or self.session.error is not None:
            self._wake()

    def _pause_reading(self) -> None:
        if not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        """The peer will send nothing more; it may still read (TLS cannot: its transport closes)."""
        self._eof = PeerGone(f"{self.label} closed the connection")
        self._wake()
        return self.transport.get_extra_info("sslcontext") is None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost_exc = exc
        self._gone = PeerGone(f"{self.label} closed the connection" if exc is None
                              else f"reading from {self.label} failed: {exc!r}")
        self._writable.set()  # (a writer waiting for room finds the connection gone)
        if not self._lost.done():
            self._lost.set_result(None)
        self._wake()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def open(self) -> Hello:
        """Run the handshake; the peer's hello. ProtocolError if the peer breaks a rule (answer it with
        `refuse`), PeerGone if it refused us, went away or went silent."""
        with contextlib.suppress(PeerGone):  # (a peer that refused us may be gone: its error is read below)
            await self._flush("hello")
        while not self.hello:
            try:
                events = await self._events(self.timeout)
            except PeerGone as exc:
                if (self.outbound and not self._received and not isinstance(exc, PeerSilent)
                        and self.transport.get_extra_info("sslcontext") is not None):
                    # a TLS node that refuses a certificate closes right after its handshake (TLS 1.3: the
                    # dialler's side of it was done), before its hello
                    why = (tls_cause(self._lost_exc, dialler=True) if isinstance(self._lost_exc, ssl.SSLError)
                           else "most likely it refused this side's certificate, which the node's --tls-ca did not "
                                "sign (give a certificate signed by the swarm's CA)")
                    raise PeerGone(f"{self.remote} closed the connection right after the TLS handshake, before "
                                   f"its hello: {why}") from exc
                raise
            for event in events:
                if isinstance(event, Refused):
                    raise PeerRefused(event.code, f"{self.remote} refused us: {event.code}: {event.text}")
                if isinstance(event, Opened):
                    self.hello, self.label = event.hello, event.hello.node
                self._count(event)
                if isinstance(event, Arrived):  # sent right behind the handshake
                    self._inbox.append(event.message)
            await self._flush("auth")
        return self.hello

    @property
    def heard(self) -> float:
        """Loop time the peer last sent bytes."""
        return self._heard

    def next_id(self) -> int:
        return self.session.next_id()

    # --- sending ----------------------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        """Send one message (the session assigns its id unless it has one)."""
        if self.closed:
            raise PeerGone(f"connection to {self.label} is closed")
        frame = self.session.send(message)
        await self._write([Outgoing(message.t, [frame], len(frame))])

    async def _flush(self, kind: str) -> None:
        """Write what the session itself queued (its hello, its proof)."""
        if frame := self.session.data_to_send():
            await self._write([Outgoing(kind, [frame], len(frame))])

    async def _write(self, frames: list[Outgoing]) -> None:
        """Write frames, each in its pieces, in order and at once (uvloop: one writev), waiting while
        the peer is slow to take them."""
        if self.closed:
            raise PeerGone(f"connection to {self.label} is closed")
        async with self._send_lock:
            if self._gone is not None or self.transport.is_closing():
                raise PeerGone(f"connection to {self.label} is closed")
            try:
                self.transport.writelines([piece for frame in frames for piece in frame.pieces])
                if not self._writable.is_set():  # (most writes leave room: no timer for them)
                    async with asyncio.timeout(self.timeout):
                        await self._writable.wait()
            except (TimeoutError, OSError) as exc:
                await self.close()
                raise PeerGone(f"sending to {self.label} failed: {exc!r}") from None
            if self._gone is not None:
                raise self._gone
        for frame in frames:
            self.traffic.count("sent", self.label, frame.kind, frame.size, frame.raw)
            self._note(frame.kind)
        self.said = asyncio.get_running_loop().time()

    async def send_tensor(self, tensor: torch.Tensor | Encoded, codec: str = "raw", compression: str = "none",
                          then: Message | None = None) -> int | None:
        """Send a tensor, and `then` a message about it; returns the stream id (None: it went in the
        message). A raw tensor that fits in a frame goes in `then` itself when its type may carry it
        (`INLINE`): one frame. Otherwise it is streamed in chunk frames, and `then` names the stream
        (in the field `STREAM_FIELDS` gives for its type, set here), sent right behind it.

        Each chunk is encoded (cast, quantised, compressed) in a worker thread, so the event loop
        keeps serving other peers while a large tensor goes out; raw data is written from the
        tensor's own memory (so it must not change once sent: senders send tensors they no longer
        write to), and so are the chunks of a tensor already `Encoded`. The stream's announcement
        goes out with its first chunk, and `then` with its last: fewer writes, and the peer wakes
        fewer times.
        """
        field = STREAM_FIELDS.get(then.t, ("",))[0] if then is not None else None
        if then is not None and SCHEMAS[then.t].get(field, "").rstrip("?") != "uint":
            raise ValueError(f"a {then.t} message names no single stream")
        if (then is not None and then.t in INLINE and isinstance(tensor, torch.Tensor) and codec == "raw"
                and compression == "none" and tensor.numel() * tensor.element_size() <= RAW_CHUNK_BYTES):
            message = then.replace(**{field: None, INLINE[then.t]: tensor})
            pieces = self.session.send_pieces(message)
            await self._write([Outgoing(message.t, pieces, sum(map(len, pieces)))])
            return None
        stream = next(self._streams)
        frames = stream_frames(tensor, stream, self.next_id, codec, compression)
        inline = isinstance(tensor, Encoded) or (codec == "raw" and compression == "none")

        async def produce() -> Outgoing | None:
            return next(frames, None) if inline else await asyncio.to_thread(next, frames, None)

        held = [await produce()]  # (the stream_begin, held for the first chunk)
        while (out := await produce()) is not None:
            if held[-1].kind != "stream_begin":
                await self._write(held)
                held = []
            held.append(out)
        if then is not None:
            if self.closed:  # (closed while the last chunk was encoded)
                raise PeerGone(f"connection to {self.label} is closed")
            message = then.replace(**{field: stream})
            frame = self.session.send(message)
            held.append(Outgoing(message.t, [frame], len(frame)))
        await self._write(held)
        return stream

    async def request(self, message: Message, timeout: float | None = None) -> Message:
        """Send a request and wait for its reply (needs `serve` running to read replies): a message of
        the type `REPLIES` names for it, or PeerGone (an error, silence, or any other type: callers
        read the reply's fields)."""
        if message.t not in REPLIES:
            raise ValueError(f"{message.t} is not a request (REPLIES lists them)")
        message = message.replace(id=self.next_id())
        future = asyncio.get_running_loop().create_future()
        self._pending[message.id] = future
        large = message.t == "state_get"  # (its reply's stream may take the whole stream budget)
        self.session.streams.asked += large
        limit = timeout or self.timeout
        try:
            await self.send(message)
            # a large reply's stream may take longer than the timeout over a slow link: it is waited for
            # while the peer's bytes keep coming, each within the timeout of the last (LARGE_WAITS at most)
            for _ in range(LARGE_WAITS if large else 1):
                heard = self._heard
                await asyncio.wait({future}, timeout=limit)
                if future.done() or self._heard == heard:
                    break
            if not future.done():
                raise TimeoutError
            reply = future.result()
        except TimeoutError:
            raise PeerGone(f"{self.label} did not answer {message.t} within {limit}s"
                           f"{' of the last bytes it sent' if large else ''}") from None
        finally:
            self._pending.pop(message.id, None)
            self.session.streams.asked -= large
        if isinstance(reply, Error):
            raise PeerGone(f"{self.label} answered {message.t} with error {reply.code}: {reply.message}")
        if reply.t != REPLIES[message.t]:
            raise PeerGone(f"{self.label} answered {message.t} with a {reply.t} message, not {REPLIES[message.t]}")
        return reply

    # --- receiving --------------------------------------------------------------------------------

    async def recv(self, timeout: float | None = None) -> Message:
        """The next message from the peer; PeerGone on close or timeout, ProtocolError on bad input."""
        while not self._inbox:
            for event in await self._events(timeout or self.timeout):
                self._count(event)
                if isinstance(event, Arrived):
                    self._inbox.append(event.message)
        return self._inbox.pop(0)

    async def _events(self, timeout: float) -> list:
        """The session's next events from the peer; PeerSilent if it sent no byte for `timeout`
        seconds (a large frame still arriving is not silence)."""
        loop = asyncio.get_running_loop()
        since = loop.time()
        while not self._events_in:
            if self.session.error is not None:  # what came before the bad frame has been handled
                raise self.session.error
            if self._gone is not None or self._eof is not None:
                raise self._gone or self._eof
            deadline = max(since, self._heard) + timeout
            if loop.time() >= deadline:
                raise PeerSilent(f"{self.label} sent nothing for {timeout}s")
            self._wakeup = loop.create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._wakeup
        events, self._events_in = self._events_in, []
        if self._reading_paused and not self.closed and self.session.error is None:
            self._reading_paused = False
            self.transport.resume_reading()
        return events

    def _count(self, event: Opened | Arrived | Frame) -> None:
        if isinstance(event, Arrived):
            self.traffic.count("received", self.label, event.message.t, event.size)
            self._note(event.message.t)
        elif isinstance(event, Frame):
            self.traffic.count("received", self.label, event.kind, event.size, event.raw)
            self._note(event.kind)

    def _note(self, kind: str) -> None:
        if kind not in KEEPALIVE:
            self.used = time.monotonic()

    async def serve(self, handler: Handler, idle_timeout: float) -> None:
        """Read until the peer goes: replies resolve waiting requests, everything else goes to handler.

        Stream frames are reassembled here; a protocol error is answered with an error message and
        the connection is closed (the node itself carries on).
        """
        try:
            while True:
                message = await self.recv(idle_timeout)
                if message.re is not None and message.re in self._pending:
                    self._pending.pop(message.re).set_result(message)
                else:
                    await handler(self, message)
        except ProtocolError as exc:
            QUIET.log(logging.WARNING, "protocol error", "protocol error from %s (%s): %s; closing", self.label,
                      self.remote, exc.message)
            await self.refuse(exc)
        except PeerGone as exc:
            if not self.closed:  # not our own close() ending the read
                QUIET.log(logging.INFO, "peer gone", "%s", exc)
        finally:
            await self.close()

    def stream_stalled(self, now: float) -> bool:
        """Whether a stream the peer opened has moved by no frame for STALLED_TIMEOUTS timeouts, or lies
        complete and unnamed that long (it holds its share of the node's stream budget meanwhile).
        Asked now and then (the node's ping loop); each call notes the stream's progress."""
        streams = self.session.streams
        if not streams.open or streams.progress != self._streams_moved[0]:
            self._streams_moved = (streams.progress, now)
            return False
        return now - self._streams_moved[1] > STALLED_TIMEOUTS * self.timeout

    async def refuse(self, exc: ProtocolError) -> None:
        """Tell the peer what it did wrong (best effort), then close."""
        if not self.closed:
            with contextlib.suppress(PeerGone):
                frame = self.session.refuse(exc)
                await self._write([Outgoing("error", [frame], len(frame))])
        await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.session.clear()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(PeerGone(f"connection to {self.label} closed"))
        self.transport.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await self._lost


async def dial(host: str, port: int, traffic: Traffic, session: Session, timeout: float,
               tls: ssl.SSLContext | None = None) -> Connection:
    """A connection to host:port (not yet through the handshake: `open` runs it). OSError or
    TimeoutError when nobody answers; TlsFailed (an OSError) naming the cause when TLS fails."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            _, conn = await loop.create_connection(lambda: Connection(traffic, session, timeout), host, port,
                                                   ssl=tls)
    except ssl.SSLError as exc:
        raise TlsFailed(f"TLS with {host}:{port} failed: {tls_cause(exc, dialler=True)}") from exc
    return conn


async def listen(host: str, port: int, make: Callable[[], Connection], tls: ssl.SSLContext | None = None,
                 backlog: int = 1024, timeout: float = 10.0) -> asyncio.Server | TlsServer:
    """A server whose every accepted socket is the Connection `make()` returns (whose `opened`
    callback takes it from there). With `tls`, a `TlsServer`: TLS within `timeout` of the
    connection, or a refusal that says why (asyncio's own would drop the peer without a word)."""
    if tls is None:
        return await asyncio.get_running_loop().create_server(make, host, port, backlog=backlog)
    server = TlsServer(make, tls, timeout)
    await server.start(host, port, backlog)
    return server
