"""Large tensors as streams of chunk frames, sans I/O.

The sender announces a stream (dtype, shape, number of chunks, elements per chunk), then sends
the flattened tensor in order, one `stream_chunk` frame per slice, each slice encoded on its own
(so encoding and compression work on about 1 MiB at a time, and can run off the event loop). The
receiver allocates the tensor once, when the stream is announced and only within its memory
budget, and copies each decoded slice into place: memory stays bounded by the budget, and nothing
is buffered twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from .codec import Budget, EncodedTensor, encode, encode_pieces
from .errors import ProtocolError
from .messages import StreamBegin
from .tensors import (
    DEFAULT_LIMITS,
    DTYPE_NAMES,
    DTYPES,
    Limits,
    as_view,
    decode_tensor,
    encode_tensor,
    encode_tensor_pieces,
)

CHUNK_BYTES = 1 << 20  # a chunk to encode (cast, quantise, compress) at a time, off the event loop
# a raw chunk has nothing to encode and is read in place: a larger one only saves frames (a
# block's part of 2 MiB, say, goes in one), and it stays well under the frame limit
RAW_CHUNK_BYTES = 2 << 20


def chunk_bytes(codec: str, compression: str) -> int:
    """The bytes of tensor data per chunk of a stream in this codec."""
    return RAW_CHUNK_BYTES if codec == "raw" and compression == "none" else CHUNK_BYTES


class Outgoing(NamedTuple):
    kind: str  # message type
    pieces: list[bytes | memoryview]  # the frame, in pieces to write one after the other
    raw: int  # bytes of tensor data the frame carries, before any codec (the frame size otherwise)

    @property
    def frame(self) -> bytes:
        return b"".join(self.pieces)

    @property
    def size(self) -> int:
        return sum(map(len, self.pieces))


class Encoded(NamedTuple):
    """A tensor encoded once for a stream, to be sent to several peers (each stream's frames differ
    only in their ids): an owner sends its averaged range to every member of its group."""

    dtype: str
    shape: list[int]
    chunk_elems: int
    chunks: list[tuple[EncodedTensor, int]]  # each chunk's payload, and its bytes before the codec


def encode_stream(tensor: torch.Tensor, codec: str = "raw", compression: str = "none") -> Encoded:
    """Every chunk of `tensor` encoded now (a few milliseconds per MiB for a lossy codec: run it off
    the event loop)."""
    flat, chunk_elems, _ = _layout(tensor, chunk_bytes(codec, compression))
    return Encoded(DTYPE_NAMES[flat.dtype], list(tensor.shape), chunk_elems,
                   list(_chunks(flat, chunk_elems, codec, compression)))


def _chunks(flat: torch.Tensor, chunk_elems: int, codec: str,
            compression: str) -> Iterator[tuple[EncodedTensor, int]]:
    for lo in range(0, flat.numel(), chunk_elems):
        piece = flat[lo : lo + chunk_elems]
        yield EncodedTensor(encode_tensor_pieces(piece, codec, compression)), piece.numel() * piece.element_size()


def stream_frames(
    tensor: torch.Tensor | Encoded, stream: int, next_id: Callable[[], int], codec: str = "raw",
    compression: str = "none", chunk_size: int | None = None,
) -> Iterator[Outgoing]:
    """Frames that carry `tensor` as stream `stream`: a stream_begin, then the chunks in order.

    Lazy: each chunk of a tensor is encoded when the iterator reaches it, so a caller can run
    `next()` in a worker thread and keep the event loop free. An `Encoded` tensor carries its own
    codec and chunking (`codec`, `compression` and `chunk_size` are then unused). `chunk_size`: bytes
    of tensor data per chunk (default: `chunk_bytes` of the codec).
    """
    if isinstance(tensor, Encoded):
        dtype, shape, chunk_elems, chunks = tensor.dtype, tensor.shape, tensor.chunk_elems, tensor.chunks
        count = len(chunks)
    else:
        flat, chunk_elems, count = _layout(tensor, chunk_size or chunk_bytes(codec, compression))
        chunks = _chunks(flat, chunk_elems, codec, compression)
        dtype, shape = DTYPE_NAMES[flat.dtype], list(tensor.shape)
    begin = encode(StreamBegin(id=next_id(), stream=stream, dtype=dtype, shape=shape, chunks=count,
                               chunk_elems=chunk_elems).to_wire())
    yield Outgoing("stream_begin", [begin], len(begin))
    for seq, (data, raw) in enumerate(chunks):  # (a tensor's chunks are encoded here, off the event loop)
        # (StreamChunk(...).to_wire() as a map: the same frame, without a message object per chunk)
        frame = encode_pieces({"t": "stream_chunk", "id": next_id(), "stream": stream, "seq": seq, "data": data})
        yield Outgoing("stream_chunk", frame, raw)


def _layout(tensor: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, int, int]:
    """(the flat tensor, elements per chunk, number of chunks) of a stream."""
    flat = tensor.detach().to("cpu").contiguous().view(-1)
    chunk_elems = max(1, chunk_size // flat.element_size())
    return flat, chunk_elems, math.ceil(flat.numel() / chunk_elems)


def through_codec(tensor: torch.Tensor, codec: str, compression: str = "none",
                  chunk_size: int | None = None) -> torch.Tensor:
    """What a receiver of `tensor` as a stream gets: every chunk encoded and decoded as on the wire.

    A sender averages its own update in this form, so every replica sums identical values.
    """
    flat, chunk_elems, chunks = _layout(tensor, chunk_size or chunk_bytes(codec, compression))
    pieces = [decode_tensor(encode_tensor(flat[i * chunk_elems : (i + 1) * chunk_elems], codec, compression))
              for i in range(chunks)]
    return torch.cat(pieces).view(tensor.shape) if pieces else flat.clone().view(tensor.shape)


class _Partial:
    def __init__(self, out: torch.Tensor, shape: list[int], chunks: int, chunk_elems: int) -> None:
        self.out, self.shape, self.chunks, self.chunk_elems = out, shape, chunks, chunk_elems
        self.memory = as_view(out)  # (its bytes, where chunks are read in place)
        self.chunk_bytes = chunk_elems * out.element_size()
        self.next_seq = 0


MAX_STREAMS = 16  # streams one connection may hold, open or complete and not yet named by a message


class StreamAssembler:
    """Reassembles the streams of one connection within a budget (bytes), shared with other
    connections when given a `Budget` of the whole process. Of a shared budget one connection holds
    at most half, and at most MAX_STREAMS streams: one peer cannot take what all the others' streams
    need (a stream that stops arriving is the connection's to close: `progress` says when one moved),
    unless this side asked for it (`asked`: a state it requested may be as large as the budget)."""

    def __init__(self, budget: int | Budget = 1 << 30, limits: Limits = DEFAULT_LIMITS) -> None:
        shared = isinstance(budget, Budget)
        self.budget = budget if shared else Budget(budget)
        self.share = self.budget.limit // 2 if shared else self.budget.limit  # what this connection may hold
        self.limits = limits
        self._partial: dict[int, _Partial] = {}
        self._done: dict[int, torch.Tensor] = {}
        self.held = 0  # bytes allocated for partial and completed, untaken streams of this connection
        self.progress = 0  # stream frames placed so far (begins and chunks)
        self.asked = 0  # replies this side is waiting for that come as one stream (state_get's): may take all

    @property
    def open(self) -> bool:
        """Whether a stream is still arriving, or complete and not yet named by a message (which
        comes right behind its last chunk)."""
        return bool(self._partial or self._done)

    def begin(self, msg: dict) -> None:
        stream, dtype, shape = msg["stream"], msg["dtype"], msg["shape"]
        if stream in self._partial or stream in self._done:
            raise ProtocolError("bad_stream", f"stream {stream} is already open")
        if dtype not in DTYPES:
            raise ProtocolError("bad_stream", f"unknown dtype {dtype!r}")
        if len(shape) > self.limits.max_dims or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ProtocolError("bad_stream", "stream shape must be a short list of non-negative integers")
        numel = math.prod(shape)
        if msg["chunk_elems"] < 1 or msg["chunks"] != math.ceil(numel / msg["chunk_elems"]):
            raise ProtocolError("bad_stream", f"{msg['chunks']} chunks of {msg['chunk_elems']} do not cover {numel}")
        nbytes = numel * DTYPES[dtype].itemsize
        if len(self._partial) + len(self._done) >= MAX_STREAMS:
            raise ProtocolError("too_many_streams", f"{MAX_STREAMS} streams are already open or not yet named by a "
                                                    "message on this connection")
        if self.held + nbytes > (self.budget.limit if self.asked else self.share):
            raise ProtocolError("too_large", f"a stream of {nbytes} bytes does not fit the receiver's budget for "
                                             f"incoming streams on one connection (this one holds {self.held} of "
                                             f"the {self.share} bytes one may hold): send it later, or in smaller "
                                             "parts")
        if not self.budget.reserve(nbytes):
            raise ProtocolError("too_large", f"a stream of {nbytes} bytes does not fit the receiver's budget for "
                                             f"incoming streams ({self.budget.held} of {self.budget.limit} bytes "
                                             "held across its connections): send it later, or in smaller parts")
        self.held += nbytes
        self.progress += 1
        part = _Partial(torch.empty(numel, dtype=DTYPES[dtype]), shape, msg["chunks"], msg["chunk_elems"])
        if part.chunks == 0:
            self._done[stream] = part.out.view(shape)
        else:
            self._partial[stream] = part

    def destination(self, msg: dict, key: str, dtype: str, nbytes: int) -> memoryview | None:
        """Where a chunk's data may be read straight into (a decoder's `Placer`): its place in its
        stream's tensor, if it is the stream's next chunk, of its dtype and size (any other frame is
        decoded, and a bad chunk refused, as usual)."""
        if msg.get("t") != "stream_chunk" or key != "data":
            return None
        stream, seq = msg.get("stream"), msg.get("seq")
        part = self._partial.get(stream) if type(stream) is int else None  # (not a bool, which validate refuses)
        if part is None or type(seq) is not int or seq != part.next_seq or dtype != DTYPE_NAMES[part.out.dtype]:
            return None
        lo = part.next_seq * part.chunk_bytes
        piece = part.memory[lo : lo + part.chunk_bytes]
        return piece if len(piece) == nbytes else None

    def chunk(self, msg: dict) -> int | None:
        """Place one chunk; returns the stream id when this chunk completed it."""
        stream = msg["stream"]
        part = self._partial.get(stream)
        if part is None:
            raise ProtocolError("bad_stream", f"chunk for stream {stream}, which is not open")
        if msg["seq"] != part.next_seq:
            raise ProtocolError("bad_stream", f"stream {stream}: chunk {msg['seq']} arrived, {part.next_seq} expected")
        lo = part.next_seq * part.chunk_elems
        hi = min(lo + part.chunk_elems, part.out.numel())
        data = msg["data"]
        if data.dim() != 1 or data.dtype != part.out.dtype or data.numel() != hi - lo:
            raise ProtocolError("bad_stream", f"stream {stream} chunk {msg['seq']}: expected {hi - lo} "
                                              f"{part.out.dtype} in one dimension, got {list(data.shape)} {data.dtype}")
        if data.data_ptr() != part.out.data_ptr() + lo * part.out.element_size():  # (unless it was read in place)
            part.out[lo:hi] = data.reshape(-1)
        part.next_seq += 1
        self.progress += 1
        if part.next_seq < part.chunks:
            return None
        del self._partial[stream]
        self._done[stream] = part.out.view(part.shape)
        return stream

    def take(self, stream: int) -> torch.Tensor:
        """A completed stream's tensor; its memory leaves the budget."""
        if stream not in self._done:
            raise ProtocolError("bad_stream", f"stream {stream} is not complete")
        tensor = self._done.pop(stream)
        nbytes = tensor.numel() * tensor.element_size()
        self.held -= nbytes
        self.budget.release(nbytes)
        return tensor

    def clear(self) -> None:
        """Drop every stream (the connection ended), returning their bytes to the budget."""
        self._partial.clear()
        self._done.clear()
        self.budget.release(self.held)
        self.held = 0
