"""One TCP connection speaking the protocol: the thin asyncio layer around the sans-I/O codec.

It owns the socket, a Decoder and a StreamAssembler, counts every frame, writes with backpressure
(`drain` under a timeout), times out every wait for the peer, and matches replies ("re") to the
requests waiting for them. Heavy tensor encoding runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable

import torch

from ..wire import Decoder, ProtocolError, StreamAssembler, encode, stream_frames
from .accounting import Traffic

log = logging.getLogger(__name__)

Handler = Callable[["Connection", dict], Awaitable[None]]


class PeerGone(Exception):
    """The peer closed the connection, stopped answering, or refused us."""


class PeerSilent(PeerGone):
    """The peer sent nothing within the timeout."""


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, traffic: Traffic,
                 timeout: float = 10.0, recv_budget: int = 1 << 30) -> None:
        self.reader, self.writer = reader, writer
        self.traffic = traffic
        self.timeout = timeout
        self.decoder = Decoder()
        self.streams = StreamAssembler(recv_budget)
        self.label = "?"  # the peer's node id once the handshake is done
        self.remote = "{}:{}".format(*writer.get_extra_info("peername")[:2])
        self.hello: dict = {}
        self.outbound = False  # True when this side dialled
        self.reader_task: asyncio.Task | None = None  # set when something else runs serve() for us
        self._ids = itertools.count(1)
        self._streams = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._inbox: list[dict] = []
        self._send_lock = asyncio.Lock()
        self.closed = False

    def next_id(self) -> int:
        return next(self._ids)

    # --- sending ----------------------------------------------------------------------------------

    async def send(self, message: dict) -> None:
        """Send one message (an id is assigned if it has none)."""
        message.setdefault("id", self.next_id())
        await self._write(encode(message), message["t"])

    async def _write(self, frame: bytes, kind: str, raw: int | None = None) -> None:
        if self.closed:
            raise PeerGone(f"connection to {self.label} is closed")
        async with self._send_lock:
            try:
                self.writer.write(frame)
                await asyncio.wait_for(self.writer.drain(), self.timeout)
            except (TimeoutError, OSError) as exc:
                await self.close()
                raise PeerGone(f"sending to {self.label} failed: {exc!r}") from None
        self.traffic.count("sent", self.label, kind, len(frame), raw)

    async def send_tensor(self, tensor: torch.Tensor, codec: str = "raw", compression: str = "none") -> int:
        """Stream a tensor in chunk frames; returns the stream id to reference in a later message.

        Each chunk is encoded (cast, quantised, compressed) in a worker thread, so the event loop
        keeps serving other peers while a large tensor goes out.
        """
        stream = next(self._streams)
        frames = stream_frames(tensor, stream, self.next_id, codec, compression)
        while (out := await asyncio.to_thread(next, frames, None)) is not None:
            await self._write(out.frame, out.kind, out.raw)
        return stream

    async def request(self, message: dict, timeout: float | None = None) -> dict:
        """Send a request and wait for its reply (needs `serve` running to read replies)."""
        message["id"] = self.next_id()
        future = asyncio.get_running_loop().create_future()
        self._pending[message["id"]] = future
        try:
            await self.send(message)
            reply = await asyncio.wait_for(future, timeout or self.timeout)
        except TimeoutError:
            raise PeerGone(f"{self.label} did not answer {message['t']} within {timeout or self.timeout}s") from None
        finally:
            self._pending.pop(message["id"], None)
        if reply["t"] == "error":
            raise PeerGone(f"{self.label} answered {message['t']} with error {reply['code']}: {reply['message']}")
        return reply

    # --- receiving --------------------------------------------------------------------------------

    async def recv(self, timeout: float | None = None) -> dict:
        """The next message from the peer; PeerGone on close or timeout, ProtocolError on bad input."""
        while not self._inbox:
            if self.decoder.error is not None:  # what came before the bad frame has been handled
                raise self.decoder.error
            try:
                data = await asyncio.wait_for(self.reader.read(1 << 18), timeout or self.timeout)
            except TimeoutError:
                raise PeerSilent(f"{self.label} sent nothing for {timeout or self.timeout}s") from None
            except OSError as exc:
                raise PeerGone(f"reading from {self.label} failed: {exc!r}") from None
            if not data:
                raise PeerGone(f"{self.label} closed the connection")
            for message, size in self.decoder.feed(data):
                raw = None
                if message["t"] == "stream_chunk":
                    raw = message["data"].numel() * message["data"].element_size()
                self.traffic.count("received", self.label, message["t"], size, raw)
                self._inbox.append(message)
        return self._inbox.pop(0)

    async def serve(self, handler: Handler, idle_timeout: float) -> None:
        """Read until the peer goes: replies resolve waiting requests, everything else goes to handler.

        Stream frames are reassembled here; a protocol error is answered with an error message and
        the connection is closed (the node itself carries on).
        """
        try:
            while True:
                message = await self.recv(idle_timeout)
                reply_to = message.get("re")
                if reply_to is not None and reply_to in self._pending:
                    self._pending.pop(reply_to).set_result(message)
                elif message["t"] == "stream_begin":
                    self.streams.begin(message)
                elif message["t"] == "stream_chunk":
                    self.streams.chunk(message)
                else:
                    await handler(self, message)
        except ProtocolError as exc:
            log.warning("protocol error from %s (%s): %s; closing", self.label, self.remote, exc.message)
            await self.refuse(exc)
        except PeerGone as exc:
            if not self.closed:  # not our own close() ending the read
                log.info("%s", exc)
        finally:
            await self.close()

    async def refuse(self, exc: ProtocolError) -> None:
        """Tell the peer what it did wrong (best effort), then close."""
        try:
            await self.send({"t": "error", "code": exc.code, "message": exc.message})
        except (PeerGone, ValueError):
            pass
        await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.streams.clear()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(PeerGone(f"connection to {self.label} closed"))
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 2.0)
        except (TimeoutError, OSError):
            pass
