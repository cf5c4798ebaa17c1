"""The protocol's conversation, sans I/O: a `Session` is fed bytes and says what happened.

In the manner of h11's `Connection`: nothing here touches a socket. The layer around it writes
`data_to_send()` to the peer, feeds what it reads to `receive_data()` (or reads into
`get_buffer()` and calls `buffer_updated()`, so that large frames are read into place) and acts on
the events that come back. The session runs the handshake (hellos, then proofs when the swarm has a secret),
refuses anything else before it is done, checks every message it sends against the schema,
reassembles tensor streams within a budget shared by the whole process, and hands each message
that names streams over with their tensors attached (a message that carries its tensor inline has
it read straight into a tensor of its own, or into memory the receiver lends for it: `Lender`).

The handshake of version 2 (proto/PROTOCOL.md, section 6) binds each side's proof to the exact
bytes of both hellos (so both nonces and both node ids), to the side that makes it (dialler or
acceptor) and to a fixed label; the dialler proves first and the acceptor proves only after
checking that proof. So a proof cannot be relayed to another connection, reflected back to its
maker or replayed later, and a node never proves anything to a peer that has not proven first.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from ..progress import QuietLog
from .codec import MAX_FRAME, Budget, Decoder, encode, encode_pieces
from .errors import ProtocolError
from .messages import INLINE, REPLIES, STREAM_FIELDS, VERSION, Auth, Error, Hello, Message, from_wire, validate
from .streams import StreamAssembler
from .tensors import DTYPES

NODE_ID = re.compile(r"[0-9a-f]{32}")  # a node id: 32 lowercase hex digits
log = logging.getLogger(__name__)
QUIET = QuietLog(log)  # (what any peer can make this log, at most a few lines a kind per period)
HANDSHAKE_MAX_FRAME = 64 << 10  # a peer that has not finished the handshake cannot make us buffer more
NONCE_BYTES = 16
LABEL = b"spheroid-handshake-v2"
# the reply types that must answer a request this side sent and has not had answered (`unexpected`
# otherwise); a pong is taken whatever it answers (it only updates the round-trip time)
CHECKED_REPLIES = frozenset(REPLIES.values()) - {"pong"}
# requests sent and not yet answered that a reply may still name (a request that timed out stays
# among them: its late reply is dropped, not refused); beyond this many the oldest are forgotten
MAX_ASKED = 1 << 12
TLS_RECORD = 0x16  # the first byte of a TLS handshake record: a peer that speaks TLS to a side that does not


class State(Enum):
    HELLO = "hello"  # waiting for the peer's hello
    AUTH = "auth"  # waiting for the peer's proof
    OPEN = "open"  # the handshake is done: any message of the protocol
    CLOSED = "closed"  # refused, or refused us: nothing more is read or sent


@dataclass(frozen=True)
class Opened:
    """The handshake is done; `hello` is the peer's."""

    hello: Hello


@dataclass(frozen=True)
class Arrived:
    """A message after the handshake (stream frames are absorbed by the session)."""

    message: Message
    size: int  # bytes of its frame, header included


@dataclass(frozen=True)
class Frame:
    """A handshake or stream frame the session took in itself (reported so that traffic is counted)."""

    kind: str
    size: int
    raw: int  # bytes of tensor data it carried


@dataclass(frozen=True)
class Refused:
    """The peer refused the handshake with an error message; the session is closed."""

    code: str
    text: str


Event = Opened | Arrived | Frame | Refused
# (the peer's node id, a frame's fields but its inline tensor, that tensor's dtype and bytes) -> memory
# of the receiver's own to read the tensor straight into, or None: a tensor of its own
Lender = Callable[[str, dict, str, int], memoryview | None]


def is_node_id(value: object) -> bool:
    return isinstance(value, str) and NODE_ID.fullmatch(value) is not None


def transcript(dialler_hello: bytes, acceptor_hello: bytes) -> bytes:
    """SHA-256 over the label and both hellos' frame bodies, each prefixed by its 4-byte length."""
    digest = hashlib.sha256(LABEL)
    for body in (dialler_hello, acceptor_hello):
        digest.update(len(body).to_bytes(4, "big"))
        digest.update(body)
    return digest.digest()


def proof(secret: bytes, transcript_hash: bytes, side: str) -> bytes:
    """What `side` ("dialler" or "acceptor") sends to show it holds the swarm secret."""
    return hmac.new(secret, LABEL + b"|" + side.encode() + b"|" + transcript_hash, hashlib.sha256).digest()


def check_uints(hello: dict, name: str) -> None:
    values = hello.get(name, [])
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ProtocolError("handshake", f"hello.{name} must be a list of block numbers (uint)")


class Session:
    """One connection's conversation. `me`: this side's hello fields (node, addr, role, blocks, boot,
    and optionally serves and model); `dialler`: whether this side opened the connection; `lend`:
    where an inline tensor may be read into, once the handshake is done (an averaged range into its
    place in the next state: the receiver's memory, that the frame's bytes overwrite as they come)."""

    def __init__(self, me: dict, *, dialler: bool, swarm: str, secret: bytes | None,
                 budget: int | Budget = 1 << 30, frames: Budget | None = None, lend: Lender | None = None) -> None:
        self.dialler = dialler
        self.lend = lend
        self.swarm = swarm
        self.secret = secret
        self.me = me
        self.state = State.HELLO
        self.peer: Hello | None = None  # the peer's hello, once received
        self.streams = StreamAssembler(budget)
        # (`frames`: the process's bytes of large frames being read into buffers of their own, inline
        # tensors read into place among them)
        self.frames = frames
        self._placing = 0  # bytes of `frames` held by the inline tensor being read into place
        self._decoder = Decoder(max_frame=HANDSHAKE_MAX_FRAME, budget=frames, place=self._destination)
        self._ids = itertools.count(1)
        self._asked: dict[int, str] = {}  # id -> type of the requests sent and not yet answered (MAX_ASKED)
        self._out = bytearray()
        self.error: ProtocolError | None = None  # what ended the session, once it is raised
        hello = Hello(id=self.next_id(), version=VERSION, swarm=swarm, **me, nonce=os.urandom(NONCE_BYTES),
                      auth=secret is not None)
        frame = encode(validate(hello.to_wire()))
        self._hellos = {"mine": frame[4:], "theirs": b""}
        self._out += frame  # both sides send hello at once

    def next_id(self) -> int:
        return next(self._ids)

    # --- sending ----------------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        """Bytes the session itself has to send (its hello, its proof, an error); empties the queue."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def send(self, message: Message) -> bytes:
        """One message as a frame, checked against its schema; an id is assigned if it has none."""
        return b"".join(self.send_pieces(message))

    def send_pieces(self, message: Message) -> list[bytes | memoryview]:
        """`send`'s frame in pieces that join into it: an inline tensor's data is a piece of its own
        (its memory, not a copy: it must not change until the frame is written)."""
        if self.state is not State.OPEN:
            raise ValueError(f"cannot send {message.t} while the session is {self.state.value}")
        if message.id is None:  # (set as a field, not added to the map: an inline tensor stays its last field)
            message = message.replace(id=self.next_id())
        wire = message.to_wire()
        try:
            validate(wire)
        except ProtocolError as exc:  # our own bug, not the peer's: say so
            raise ValueError(f"refusing to send an invalid message: {exc.message}") from None
        pieces = encode_pieces(wire)
        if message.t in REPLIES and message.t != "ping":  # (a reply must name one: pongs are taken as they come)
            self._asked[message.id] = message.t
            if len(self._asked) > MAX_ASKED:
                del self._asked[next(iter(self._asked))]
        return pieces

    def clear(self) -> None:
        """Drop every stream and frame not yet complete (the connection ended): their bytes return to
        the budget."""
        self.state = State.CLOSED
        self.streams.clear()
        self._decoder.clear()
        self._placed()

    def refuse(self, error: ProtocolError) -> bytes:
        """The error frame that tells the peer why we close; the session is closed."""
        self.state = State.CLOSED
        return encode(Error(id=self.next_id(), code=error.code, message=error.message).to_wire())

    # --- receiving --------------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed bytes from the peer; the events they complete, in order.

        A protocol error ends the session: the events before it are returned first and the error
        is raised by the next call (at once if there were none); `refuse` then gives the error
        frame to send before closing.
        """
        if self.error is not None:
            raise self.error
        if self.state is not State.CLOSED:
            self._decoder.receive(data)
        return self._events()

    def get_buffer(self) -> memoryview:
        """Where a socket read should put the next bytes from the peer (then call `buffer_updated`):
        a large frame's bytes go straight into place, without the copy `receive_data` makes."""
        return self._decoder.get_buffer()

    def buffer_updated(self, n: int) -> list[Event]:
        """`n` bytes were read into the last `get_buffer()`; the events they complete, as `receive_data`."""
        if self.error is not None:
            raise self.error
        if self.state is not State.CLOSED:
            self._decoder.buffer_updated(n)
        return self._events()

    def _events(self) -> list[Event]:
        events: list[Event] = []
        try:
            while self.state is not State.CLOSED and (received := self._decoder.next_message()) is not None:
                if self._placing and not received.body:  # (frames read into place have no body)
                    self._placed()
                events += self._handle(received.message, received.size, received.body)
        except ProtocolError as exc:
            if self._decoder.first == TLS_RECORD and self.state is State.HELLO and exc.code == "too_large":
                exc = ProtocolError(exc.code, "the peer speaks TLS and this side does not (its first bytes are a TLS "
                                              "record, not a frame): both sides need TLS, or neither")
                self._decoder.error = exc
            self.error = exc
            if not events:
                raise exc from None
        except Exception as exc:  # a check this code lacks: still the peer's bytes, not a reason to crash
            QUIET.log(logging.ERROR, "unhandled frame", "a frame from the peer could not be handled", exc_info=True)
            self.error = ProtocolError("bad_frame", f"the frame could not be decoded: {exc!r}")
            if not events:
                raise self.error from None
        return events

    def _handle(self, message: dict, size: int, body: bytes) -> list[Event]:
        kind = message["t"]
        if self.state is State.OPEN:
            return self._handle_open(message, size, placed=not body)
        if kind == "error":
            self.state = State.CLOSED
            return [Refused(message["code"], message["message"])]
        return [Frame(kind, size, size), *self._handshake(message, body)]

    def _handshake(self, message: dict, body: bytes) -> list[Event]:
        kind = message["t"]
        if self.state is State.HELLO:
            if kind != "hello":
                raise ProtocolError("handshake", f"expected hello first, got {kind}")
            self._check_hello(message)
            self.peer, self._hellos["theirs"] = from_wire(message), body
            if self.secret is None:
                return self._open()
            self.state = State.AUTH
            if self.dialler:  # the dialler proves first
                self._send_proof()
            return []
        if kind != "auth":
            raise ProtocolError("handshake", f"expected auth, got {kind}")
        peer_side = "acceptor" if self.dialler else "dialler"
        if not hmac.compare_digest(message["mac"], proof(self.secret, self._transcript(), peer_side)):
            raise ProtocolError("auth_failed", "authentication failed: the peer's swarm secret is not this side's "
                                               "(or its proof was made for another connection)")
        if not self.dialler:  # the acceptor proves only once the dialler has
            self._send_proof()
        return self._open()

    def _check_hello(self, hello: dict) -> None:
        if hello["version"] != VERSION:
            raise ProtocolError("version", f"the peer speaks protocol version {hello['version']} and this side "
                                           f"{VERSION}: upgrade the older one")
        if hello["swarm"] != self.swarm:
            raise ProtocolError("swarm", f"swarm {hello['swarm']!r} is not {self.swarm!r}")
        if hello["auth"] and self.secret is None:
            raise ProtocolError("auth_required", "the peer has a swarm secret and this side has none")
        if not hello["auth"] and self.secret is not None:
            raise ProtocolError("auth_required", "this side has a swarm secret and the peer has none")
        if not is_node_id(hello["node"]):
            raise ProtocolError("handshake", "node id must be 32 lowercase hex digits")
        if hello["node"] == self.me["node"]:
            raise ProtocolError("self", "connected to itself")
        if len(hello["nonce"]) < NONCE_BYTES:
            raise ProtocolError("handshake", f"nonce must be at least {NONCE_BYTES} bytes")
        check_uints(hello, "blocks")
        check_uints(hello, "serves")

    def _transcript(self) -> bytes:
        mine, theirs = self._hellos["mine"], self._hellos["theirs"]
        return transcript(mine, theirs) if self.dialler else transcript(theirs, mine)

    def _send_proof(self) -> None:
        side = "dialler" if self.dialler else "acceptor"
        self._out += encode(Auth(id=self.next_id(), mac=proof(self.secret, self._transcript(), side)).to_wire())

    def _open(self) -> list[Event]:
        self.state = State.OPEN
        self._decoder.max_frame = MAX_FRAME
        return [Opened(self.peer)]

    def _destination(self, msg: dict, key: str, dtype: str, nbytes: int) -> memoryview | None:
        """Where the raw tensor that ends a frame is read, as it arrives: a stream chunk's data into
        its place in its stream's tensor, a message's inline tensor into a tensor of its own (handed
        over with the message). None: anywhere else (the frame is then decoded as usual)."""
        if self.state is State.OPEN and INLINE.get(msg.get("t")) == key and type(dtype) is str and dtype in DTYPES:
            if self.lend is not None and (lent := self.lend(self.peer.node, msg, dtype, nbytes)) is not None:
                return lent  # (the receiver's memory: not counted in the frames in flight)
            if self.frames is not None and not self.frames.reserve(nbytes):
                return None  # (the process's frames in flight are at their limit)
            self._placing = nbytes  # (within a frame: at most max_frame)
            return memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())
        return self.streams.destination(msg, key, dtype, nbytes)

    def _placed(self) -> None:
        """The inline tensor being read into place is in (or the session ended): its bytes leave the
        frames in flight (it is the message's now)."""
        if self.frames is not None:
            self.frames.release(self._placing)
        self._placing = 0

    def _handle_open(self, message: dict, size: int, placed: bool) -> list[Event]:
        kind = message["t"]
        if kind == "stream_begin":
            self.streams.begin(message)
            return [Frame(kind, size, size)]
        if kind == "stream_chunk":
            self.streams.chunk(message)
            data = message["data"]
            return [Frame(kind, size, data.numel() * data.element_size())]
        if kind in ("hello", "auth"):
            raise ProtocolError("unexpected", f"{kind} after the handshake")
        re = message.get("re")
        if (re is None or self._asked.pop(re, None) is None) and kind in CHECKED_REPLIES:
            raise ProtocolError("unexpected", f"{kind} answering {'nothing' if re is None else f'message {re}'}: "
                                              "no request of this side's awaits it")
        attached = {}
        if kind in STREAM_FIELDS:  # the message names streams: hand it over with their tensors
            field, attach = STREAM_FIELDS[kind]
            named = message.get(field)
            if kind in INLINE and attach in message and not placed:  # (a view of the frame's bytes: one of its own)
                message[attach] = message[attach].clone()
            if isinstance(named, list):
                if not all(isinstance(i, int) and not isinstance(i, bool) for i in named):
                    raise ProtocolError("bad_field", f"{kind}: {field} must be stream ids")
                attached[attach] = [self.streams.take(i) for i in named]
            elif named is not None:
                attached[attach] = self.streams.take(named)
        return [Arrived(from_wire(message, **attached), size)]
