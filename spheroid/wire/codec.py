"""Frames and messages, sans I/O: `encode(message) -> bytes` and a `Decoder` fed bytes.

A frame is a 4-byte big-endian length N followed by N bytes of msgpack. The length is checked
against the limit before any byte of the body is buffered, the body is unpacked with msgpack's own
limits, extension types other than the tensor are refused, and the result is checked against the
message schema. Nothing here touches a socket, so every property is tested on plain bytes.

Frames are written in the canonical form of proto/PROTOCOL.md (section 1): msgpack's shortest
forms, floats as float64, and a message's fields in its schema's order (`Message.to_wire`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import msgpack
import torch

from .errors import ProtocolError
from .messages import INLINE, TENSOR_FIELDS, validate
from .tensors import (
    DEFAULT_LIMITS,
    EXT_TENSOR,
    HEAD_BYTES,
    Limits,
    decode_fields,
    decode_tensor,
    encode_tensor,
    encode_tensor_pieces,
    tensor_head,
    tensor_tail,
)

HEADER = struct.Struct(">I")
MAX_FRAME = 4 << 20  # 4 MiB: a stream chunk or an inline tensor (up to 2 MiB of data) fits with room to spare
MAX_STR = 1 << 16


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor already turned into its extension payload, in pieces (for encoding off the event
    loop, and writing the data without joining it to the frame's other bytes)."""

    pieces: list[bytes | memoryview]

    @property
    def size(self) -> int:
        return sum(map(len, self.pieces))


def _default(obj: Any) -> Any:
    if isinstance(obj, EncodedTensor):
        return msgpack.ExtType(EXT_TENSOR, b"".join(obj.pieces))
    if isinstance(obj, torch.Tensor):
        return msgpack.ExtType(EXT_TENSOR, encode_tensor(obj))
    raise TypeError(f"cannot send a {type(obj).__name__} on the wire")


def encode(message: dict, max_frame: int = MAX_FRAME) -> bytes:
    """One message as one frame. Tensors travel raw unless given as EncodedTensor."""
    return b"".join(encode_pieces(message, max_frame))


def encode_pieces(message: dict, max_frame: int = MAX_FRAME) -> list[bytes | memoryview]:
    """One message as one frame, in pieces that join into it. A tensor (raw) or an EncodedTensor at
    the top level of the message keeps its data as a piece of its own, so that the frame is written
    without copying it again (into msgpack's buffer, then behind the length): a raw tensor's data is
    its own memory, which must not change until the frame is written."""
    packer = msgpack.Packer(default=_default, use_bin_type=True, autoreset=False)  # (one for the frame: cheaper)
    pack = packer.pack
    pieces, before = [], b""  # before: the current piece's bytes ahead of the packer's
    for key, value in message.items():
        pack(key)
        if type(value) is not EncodedTensor and isinstance(value, torch.Tensor):
            value = EncodedTensor(encode_tensor_pieces(value))
        if type(value) is EncodedTensor:
            head, data, tail = value.pieces
            pieces += [before + packer.bytes() + ext_header(EXT_TENSOR, value.size) + head, data]
            packer.reset()
            before = tail
        else:
            pack(value)
    pieces.append(before + packer.bytes())
    header = map_header(len(message))
    size = len(header) + sum(map(len, pieces))
    if size > max_frame:
        raise ValueError(f"{message.get('t')} message of {size} bytes exceeds the frame limit of {max_frame}; "
                         "send large tensors as a stream")
    pieces[0] = HEADER.pack(size) + header + pieces[0]
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


def decode_body(body: bytes | bytearray | memoryview, max_frame: int = MAX_FRAME,
                limits: Limits = DEFAULT_LIMITS) -> dict:
    """One frame body -> a validated message. Its tensors decode to at most `max_frame` bytes in all,
    and stand only in fields that take one (`TENSOR_FIELDS`): a few kilobytes of compressed zeros
    cannot make the receiver allocate gigabytes, and before the handshake (frames of 64 KiB) no more
    than that."""
    limits = replace(limits, max_bytes=min(limits.max_bytes, max_frame))
    message = _tensor_last(body, limits) if len(body) > HEAD_BYTES else None
    if message is not None:
        return validate(message)
    decoded = []  # bytes of each tensor decoded so far

    def ext_hook(code: int, data: bytes) -> Any:
        if code != EXT_TENSOR:
            raise ProtocolError("unknown_ext", f"extension type {code} is not part of the protocol")
        tensor = decode_tensor(data, replace(limits, max_bytes=limits.max_bytes - sum(decoded)))
        decoded.append(tensor.numel() * tensor.element_size())
        return tensor

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
        if str(exc).startswith("invalid timestamp data"):  # (extension -1 of a length msgpack's timestamp has not)
            raise ProtocolError("unknown_ext", TIMESTAMP) from None
        raise ProtocolError("bad_msgpack", f"frame body is not valid msgpack within limits: {exc}") from None
    if not isinstance(body, (bytes, bytearray)) or may_hide(body):  # (a memoryview's `in` compares items)
        check_plain(message)
    message = validate(message)
    if len(decoded) != sum(isinstance(message.get(name), torch.Tensor) for name in TENSOR_FIELDS[message["t"]]):
        raise ProtocolError("bad_field", f"{message['t']}: a tensor in a field that takes none")
    return message


TIMESTAMP = "extension type -1 (msgpack's timestamp) is not part of the protocol"


def check_plain(value: Any) -> None:
    """Refuse what msgpack lets through and the protocol does not: a map key that is not a str
    (`bad_msgpack`: msgpack's strict_map_key lets bin keys in) and extension type -1 (`unknown_ext`:
    msgpack decodes it as its Timestamp itself, never asking the ext_hook). Walks the decoded
    message's containers once."""
    if type(value) is msgpack.Timestamp:
        raise ProtocolError("unknown_ext", TIMESTAMP)
    stack = [value] if type(value) in (dict, list) else []
    while stack:
        item = stack.pop()
        if type(item) is dict:
            for key in item:
                if type(key) is not str:
                    raise ProtocolError("bad_msgpack", f"a map key must be a str, not {type(key).__name__}")
            item = item.values()
        for v in item:
            kind = type(v)
            if kind is dict or kind is list:
                stack.append(v)
            elif kind is msgpack.Timestamp:
                raise ProtocolError("unknown_ext", TIMESTAMP)


def may_hide(body: bytes | bytearray) -> bool:
    """Whether a body may hold what `check_plain` refuses: a bin (c4, c5, c6) for a key, or the type
    byte of extension -1 (ff). Most frames hold neither, and are not walked."""
    return any(marker in body for marker in (b"\xff", b"\xc4", b"\xc5", b"\xc6"))


# a frame's fields before its last, a tensor, fit in this for the tensor to be decoded from the
# frame's bytes or read into place (a reduced cell's leaf digests, 32 bytes per 64 KiB of it, are
# among them); a frame whose fields are longer is decoded by msgpack
FIELDS_BYTES = 1 << 13
TENSOR_LAST = {"stream_chunk", *INLINE}  # the types whose frames may end in a tensor
FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}  # msgpack's fixext markers -> data bytes
EXT_LENGTH = {0xC7: 1, 0xC8: 2, 0xC9: 4}  # ext 8/16/32 markers -> bytes of the length after them


def _tensor_last(body: bytes | bytearray | memoryview, limits: Limits) -> dict | None:
    """A message whose last field is a tensor (a stream chunk's data, an inline tensor), the tensor
    decoded from the frame's own bytes: msgpack would copy them first, and they are nearly the whole
    frame. None for any other frame (decoded by msgpack, as any such frame may be)."""
    view = memoryview(body)
    found = _head(view, len(view))
    if found is None:
        return None
    message, key, start = found
    message[key] = decode_tensor(view[start:], limits)
    return message


def _head(view: memoryview, size: int) -> tuple[dict, str, int] | None:
    """From the first bytes of a frame body of `size` bytes, if it is a map whose last entry is a
    tensor (as spheroid writes stream chunks and inline tensors): its other fields, the last one's
    name, and where its tensor's payload starts. None for any other frame."""
    head = msgpack.Unpacker(raw=False, strict_map_key=True, max_str_len=MAX_STR, max_bin_len=FIELDS_BYTES,
                            max_array_len=1 << 8, max_map_len=32, max_ext_len=0)
    head.feed(view[:FIELDS_BYTES])
    try:
        entries = head.read_map_header()
        first = head.unpack(), head.unpack()  # (spheroid writes the type first)
        if first[0] != "t" or first[1] not in TENSOR_LAST:
            return None
        message = dict([first] + [(head.unpack(), head.unpack()) for _ in range(entries - 2)])
        last = head.unpack()
    except Exception:  # (not this layout, or not msgpack: the general decoding says which)
        return None
    # (a tensor in a field that takes none, a key that is not a str, or a timestamp: decoded by msgpack,
    # which finds the faults in the order any frame's are found)
    if type(last) is not str or last not in TENSOR_FIELDS[message["t"]] or (at := head.tell()) >= len(view):
        return None
    try:
        check_plain(message)
    except ProtocolError:
        return None
    marker = view[at]
    if marker in FIXEXT:
        length, start = FIXEXT[marker], at + 2
    elif marker in EXT_LENGTH:
        start = at + 2 + EXT_LENGTH[marker]
        length = int.from_bytes(view[at + 1 : start - 1], "big")
    else:
        return None
    if start > len(view) or start + length != size or view[start - 1] != EXT_TENSOR:
        return None
    return message, last, start


class InPlace(NamedTuple):
    """A frame's last field, a raw tensor, being read straight into place (a stream chunk's into its
    stream's tensor, an inline tensor into one of its own): what came before its data, and how many
    bytes of the frame come after it."""

    message: dict  # the frame's fields but the tensor
    key: str  # the tensor's field
    fields: list  # its tensor's dtype, shape, codec and compression
    dest: memoryview  # where its data goes
    tail: int  # bytes of the frame after the data (the tensor's scales and block)
    size: int  # the frame body's length


# (a frame's fields, its last field's name, that tensor's dtype, its data bytes) -> where the data
# goes, or None (then the frame is read and decoded as usual)
Placer = Callable[[dict, str, str, int], memoryview | None]


class Received(NamedTuple):
    message: dict
    size: int  # bytes the frame took on the wire, header included
    body: bytes | memoryview  # the frame's body as received (a handshake binds the hellos' exact bytes);
    #                           empty for a frame read in place


class Budget:
    """Bytes of incoming streams and large frames one process may hold, shared by all its
    connections' assemblers and decoders: what many peers together can make a node allocate is
    bounded, not just what each one can."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def reserve(self, nbytes: int) -> bool:
        if self.held + nbytes > self.limit:
            return False
        self.held += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.held -= nbytes


class Decoder:
    """Give it bytes as they arrive; it returns the complete messages, or raises ProtocolError.

    Bytes come in two ways: `receive(data)` copies them in, and `get_buffer()` then
    `buffer_updated(n)` let a socket read write straight into the decoder's memory (asyncio's
    BufferedProtocol). Small frames collect in a scratch buffer; once a frame's header says it is
    larger than `DIRECT` bytes, its body gets a buffer of its own (within the process's `budget`,
    or the frame waits in the scratch buffer as it arrives) and the rest of it is read into place.
    With a `place` (a session's), a frame whose last field is a raw tensor (a stream chunk's data,
    a message's inline tensor) has its data read straight into the place it says, once the frame's
    first bytes say what it is (into the stream's tensor, or into a tensor of its own): the kernel's
    copy is the only one.

    Messages that were complete before a bad frame are returned first, in order; the error is then
    in `error` and raised by the next call. After an error the decoder is dead: the connection must
    be closed, since the byte stream can no longer be trusted to be aligned on frames.
    """

    ROOM = 1 << 15  # the least room a read is offered in the scratch buffer (allocated at the first read)
    READ = 1 << 16  # the most a read is offered there (what one read can make into messages is bounded)
    DIRECT = 1 << 16  # frames with a larger body are read into a buffer of their own
    PREFIX = FIELDS_BYTES + HEAD_BYTES  # a frame's fields and its tensor's header fit in this, before the data
    TAIL = 16  # the most bytes after a raw tensor's data (its scales and block: 3) for it to be read in place

    def __init__(self, max_frame: int = MAX_FRAME, limits: Limits = DEFAULT_LIMITS,
                 budget: Budget | None = None, place: Placer | None = None) -> None:
        self.max_frame = max_frame
        self.limits = limits
        self.budget = budget  # a large frame's own buffer is taken from it (or it waits in the scratch buffer)
        self.place = place
        self._in_place: InPlace | None = None  # a frame whose tensor's data is being read into place
        self._scratch = bytearray()  # (it grows while a frame larger than it waits in it, and shrinks after)
        self._start = self._end = 0  # the scratch's bytes [start, end) are received and not yet taken
        self._body: memoryview | None = None  # a large frame's body, read into place
        self._filled = 0  # bytes of `_body` (or of the data read in place) received
        self._need: int | None = None  # body length of the frame being read, once its header is in
        self.first: int | None = None  # the first byte received (a TLS record's 0x16 is no frame's)
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
        data = memoryview(data)
        while data:
            with self.get_buffer() as buffer:
                n = min(len(buffer), len(data))
                buffer[:n] = data[:n]
            self.buffer_updated(n)
            data = data[n:]

    def get_buffer(self) -> memoryview:
        """Where the next bytes received go (at least one byte of room)."""
        if self._body is not None and self._filled < len(self._body):
            return memoryview(self._body)[self._filled :]
        if self._in_place is not None and self._filled < len(self._in_place.dest):
            return self._in_place.dest[self._filled :]
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._scratch) > 2 * self.READ:  # (a frame that waited here is gone: give its memory back)
                self._scratch = bytearray()
        if len(self._scratch) - self._end < self.ROOM:  # make room: move what waits to the front, or grow
            waiting = self._end - self._start
            size = max(len(self._scratch), waiting + self.ROOM)
            scratch = self._scratch if size == len(self._scratch) else bytearray(2 * size)
            scratch[:waiting] = self._scratch[self._start : self._end]
            self._scratch, self._start, self._end = scratch, 0, waiting
        return memoryview(self._scratch)[self._end : self._end + self.READ]

    def buffer_updated(self, n: int) -> None:
        """`n` bytes were written at the start of the last `get_buffer()`."""
        if ((self._body is not None and self._filled < len(self._body))
                or (self._in_place is not None and self._filled < len(self._in_place.dest))):
            self._filled += n
        else:
            if self.first is None and n:
                self.first = self._scratch[self._end]
            self._end += n

    def next_message(self) -> Received | None:
        """The next complete message, or None until more bytes arrive. Each frame's length is checked
        against `max_frame` as it stands when the frame's turn comes, so a session can raise the
        limit after its handshake without refusing a large frame already buffered behind it."""
        if self.error is not None:
            raise self.error
        try:
            if self._body is not None:
                if self._filled < len(self._body):
                    return None
                body, self._body, self._need = self._body, None, None
                self._release(len(body))
                return Received(decode_body(body, self.max_frame, self.limits), HEADER.size + len(body), body)
            if self._in_place is not None:
                return self._placed()
            if self._need is None:
                if self._end - self._start < HEADER.size:
                    return None
                (length,) = HEADER.unpack_from(self._scratch, self._start)
                self._start += HEADER.size
                if length == 0:
                    raise ProtocolError("bad_frame", "zero-length frame")
                if length > self.max_frame:
                    raise ProtocolError("too_large", f"frame of {length} bytes exceeds {self.max_frame}")
                self._need = length
            waiting = self._end - self._start
            if waiting < self._need:
                if self._need > self.DIRECT and self.place is not None:
                    if waiting < self.PREFIX:
                        return None  # (its first bytes say whether it is a chunk whose data can go in place)
                    if self._read_in_place():
                        return self._placed()
                if self._need > self.DIRECT and (self.budget is None or self.budget.reserve(self._need)):
                    # the rest of this frame is read straight into a buffer of its own (uninitialised:
                    # zeroing it would cost as much as a copy)
                    self._body = memoryview(torch.empty(self._need, dtype=torch.uint8).numpy())
                    self._body[:waiting] = self._scratch[self._start : self._end]
                    self._filled, self._start, self._end = waiting, 0, 0
                return None
            body = bytes(self._scratch[self._start : self._start + self._need])
            self._start += self._need
            self._need = None
            return Received(decode_body(body, self.max_frame, self.limits), HEADER.size + len(body), body)
        except ProtocolError as exc:
            self.error = exc
            raise

    def _read_in_place(self) -> bool:
        """Whether the frame now starting ends in a raw tensor whose data `place` says where to put:
        then its fields are taken, its data received so far goes there, and the rest follows."""
        view = memoryview(self._scratch)[self._start : self._end]
        found = _head(view, self._need)
        if found is None:
            return False
        message, key, start = found
        try:
            fields, data_start, data_end = tensor_head(view[start:])
        except ProtocolError:  # (decoded as usual, which says what is wrong)
            return False
        if (fields[2:] != ["raw", "none"] or start + data_start > len(view) or start + data_end > self._need
                or self._need - start - data_end > self.TAIL):
            return False
        dest = self.place(message, key, fields[0], data_end - data_start)
        if dest is None or len(dest) != data_end - data_start:
            return False
        self._in_place = InPlace(message, key, fields, dest, self._need - start - data_end, self._need)
        self._start += start + data_start
        self._filled = min(self._end - self._start, len(dest))
        dest[: self._filled] = self._scratch[self._start : self._start + self._filled]
        self._start += self._filled
        return True

    def _placed(self) -> Received | None:
        """The frame read in place, once its data and the bytes after it are in."""
        chunk = self._in_place
        if self._filled < len(chunk.dest) or self._end - self._start < chunk.tail:
            return None
        tail = memoryview(self._scratch)[self._start : self._start + chunk.tail]
        self._start += chunk.tail
        self._in_place, self._need = None, None
        tensor = decode_fields(*chunk.fields, chunk.dest, *tensor_tail(tail), self.limits)
        return Received(validate({**chunk.message, chunk.key: tensor}), HEADER.size + chunk.size, b"")

    def clear(self) -> None:
        """Drop what is buffered (the connection ended), returning a large frame's buffer to the budget."""
        if self._body is not None:
            self._release(len(self._body))
        self._body, self._need, self._scratch, self._start, self._end = None, None, bytearray(), 0, 0
        self._in_place = None

    def _release(self, nbytes: int) -> None:
        if self.budget is not None:
            self.budget.release(nbytes)

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet form a complete frame (0 between frames)."""
        header = HEADER.size if self._need is not None else 0
        if self._body is not None:
            return header + self._filled
        if self._in_place is not None:
            chunk = self._in_place  # (what came before its data, its data so far, and what came after)
            return header + chunk.size - len(chunk.dest) - chunk.tail + self._filled + self._end - self._start
        return header + self._end - self._start
