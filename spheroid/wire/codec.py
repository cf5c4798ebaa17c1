"""Frames and messages, sans I/O: `encode(message) -> bytes` and a `Decoder` fed bytes.

A frame is a 4-byte big-endian length N followed by N bytes of msgpack. The length is checked
against the limit before any byte of the body is buffered, the body is unpacked with msgpack's own
limits, extension types other than the tensor are refused, and the result is checked against the
message schema. Nothing here touches a socket, so every property is tested on plain bytes.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import torch

from .errors import ProtocolError
from .messages import validate
from .tensors import DEFAULT_LIMITS, EXT_TENSOR, Limits, decode_tensor, encode_tensor

HEADER = struct.Struct(">I")
MAX_FRAME = 4 << 20  # 4 MiB: a stream chunk (up to 1 MiB of tensor data) fits with room to spare
MAX_STR = 1 << 16


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor already turned into its extension payload, in pieces (for encoding off the event
    loop, and writing the data without joining it to the frame's other bytes)."""

    pieces: list[bytes]

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.pieces)


def _default(obj: Any) -> Any:
    if isinstance(obj, EncodedTensor):
        return msgpack.ExtType(EXT_TENSOR, b"".join(obj.pieces))
    if isinstance(obj, torch.Tensor):
        return msgpack.ExtType(EXT_TENSOR, encode_tensor(obj))
    raise TypeError(f"cannot send a {type(obj).__name__} on the wire")


def encode(message: dict, max_frame: int = MAX_FRAME) -> bytes:
    """One message as one frame. Tensors travel raw unless given as EncodedTensor."""
    return b"".join(encode_pieces(message, max_frame))


def encode_pieces(message: dict, max_frame: int = MAX_FRAME) -> list[bytes]:
    """One message as one frame, in pieces that join into it. An EncodedTensor at the top level of
    the message keeps its data as a piece of its own, so that the frame is written without copying
    it again (into msgpack's buffer, then behind the length)."""
    pieces, small = [], []  # small: bytes not yet put in a piece
    for key, value in message.items():
        if isinstance(value, EncodedTensor):
            head, data, tail = value.pieces
            small += [msgpack.packb(key), ext_header(EXT_TENSOR, value.size), head]
            pieces += [b"".join(small), data]
            small = [tail]
        else:
            small.append(msgpack.packb(key) + msgpack.packb(value, default=_default, use_bin_type=True))
    pieces.append(b"".join(small))
    size = len(map_header(len(message))) + sum(len(p) for p in pieces)
    if size > max_frame:
        raise ValueError(f"{message.get('t')} message of {size} bytes exceeds the frame limit of {max_frame}; "
                         "send large tensors as a stream")
    pieces[0] = HEADER.pack(size) + map_header(len(message)) + pieces[0]
    return pieces


def map_header(n: int) -> bytes:
    """msgpack's header of an n-entry map, in its shortest form."""
    if n < 16:
        return bytes([0x80 | n])
    if n < 1 << 16:
        return b"\xde" + n.to_bytes(2, "big")
    return b"\xdf" + n.to_bytes(4, "big")


def ext_header(code: int, n: int) -> bytes:
    """msgpack's header of an n-byte extension of type `code`, in its shortest form."""
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if n in fixed:
        return bytes([fixed[n], code])
    if n < 1 << 8:
        return b"\xc7" + n.to_bytes(1, "big") + bytes([code])
    if n < 1 << 16:
        return b"\xc8" + n.to_bytes(2, "big") + bytes([code])
    return b"\xc9" + n.to_bytes(4, "big") + bytes([code])


def decode_body(body: bytes, max_frame: int = MAX_FRAME, limits: Limits = DEFAULT_LIMITS) -> dict:
    """One frame body -> a validated message."""

    def ext_hook(code: int, data: bytes) -> Any:
        if code != EXT_TENSOR:
            raise ProtocolError("unknown_ext", f"extension type {code} is not part of the protocol")
        return decode_tensor(data, limits)

    try:
        message = msgpack.unpackb(
            body, ext_hook=ext_hook, raw=False, strict_map_key=True,
            max_str_len=MAX_STR, max_bin_len=max_frame, max_array_len=1 << 16, max_map_len=1 << 12,
            max_ext_len=max_frame,
        )
    except ProtocolError:
        raise
    except msgpack.exceptions.StackError:
        raise ProtocolError("too_deep", "message nests too deeply") from None
    except msgpack.exceptions.ExtraData:
        raise ProtocolError("bad_frame", "frame holds bytes after its message") from None
    except (ValueError, TypeError, msgpack.exceptions.UnpackException) as exc:
        raise ProtocolError("bad_msgpack", f"frame body is not valid msgpack within limits: {exc}") from None
    return validate(message)


class Received(NamedTuple):
    message: dict
    size: int  # bytes the frame took on the wire, header included
    body: bytes  # the frame's body as received (a handshake binds the hellos' exact bytes)


class Decoder:
    """Feed it bytes as they arrive; it returns the complete messages, or raises ProtocolError.

    Messages that were complete before a bad frame are returned first, in order; the error is then
    in `error` and raised by the next call. After an error the decoder is dead: the connection must
    be closed, since the byte stream can no longer be trusted to be aligned on frames.
    """

    def __init__(self, max_frame: int = MAX_FRAME, limits: Limits = DEFAULT_LIMITS) -> None:
        self.max_frame = max_frame
        self.limits = limits
        # What arrived and is not yet a frame, as received: a frame's bytes are joined once, when it
        # is complete (appending to one growing buffer copied a large frame several times over).
        self._pieces: deque[bytes | memoryview] = deque()
        self._size = 0
        self._need: int | None = None  # body length of the frame being read, once its header is in
        self.error: ProtocolError | None = None

    def feed(self, data: bytes) -> list[Received]:
        """Buffer data and return every message it completes."""
        self.receive(data)
        messages = []
        try:
            while (received := self.next_message()) is not None:
                messages.append(received)
        except ProtocolError:
            if not messages:
                raise
        return messages

    def receive(self, data: bytes) -> None:
        """Buffer data; `next_message` then takes the messages out one at a time."""
        if self.error is not None:
            raise self.error
        if data:
            self._pieces.append(data if isinstance(data, bytes) else bytes(data))
            self._size += len(data)

    def next_message(self) -> Received | None:
        """The next complete message, or None until more bytes arrive. Each frame's length is checked
        against `max_frame` as it stands when the frame's turn comes, so a session can raise the
        limit after its handshake without refusing a large frame already buffered behind it."""
        if self.error is not None:
            raise self.error
        try:
            if self._need is None:
                if self._size < HEADER.size:
                    return None
                (length,) = HEADER.unpack(self._take(HEADER.size))
                if length == 0:
                    raise ProtocolError("bad_frame", "zero-length frame")
                if length > self.max_frame:
                    raise ProtocolError("too_large", f"frame of {length} bytes exceeds {self.max_frame}")
                self._need = length
            if self._size < self._need:
                return None
            body = self._take(self._need)
            self._need = None
            return Received(decode_body(body, self.max_frame, self.limits), HEADER.size + len(body), body)
        except ProtocolError as exc:
            self.error = exc
            raise

    def _take(self, n: int) -> bytes:
        """The first n buffered bytes (n <= what is buffered), out of the buffer: one copy at most."""
        taken: list[bytes | memoryview] = []
        while n:
            piece = self._pieces[0]
            if len(piece) <= n:
                taken.append(self._pieces.popleft())
            else:
                view = memoryview(piece)
                taken.append(view[:n])
                self._pieces[0] = view[n:]
            n -= len(taken[-1])
            self._size -= len(taken[-1])
        if len(taken) == 1 and isinstance(taken[0], bytes):
            return taken[0]
        return b"".join(taken)

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet form a complete frame (0 between frames)."""
        return self._size + (HEADER.size if self._need is not None else 0)
