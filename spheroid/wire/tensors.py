"""Tensors on the wire: the msgpack extension type and its codecs (raw, fp16, bf16, int8, int4, int2; lz4 on top).

Every tensor codec is one class here, registered in `TENSOR_CODECS` (by its name on the wire) and
`CODEC_OPTIONS` (by the name configs and the command line give it): the wire, the averaging, the refreshes
and the command line all read their codecs from there, so a new codec is a class here and its test.

Extension type 1 carries one tensor. Its payload is itself a msgpack array:

    [dtype, shape, codec, compression, data, scales, block]

`dtype` is the tensor's dtype after decoding; `codec` says how `data` holds the values ("raw": in
dtype itself; "fp16"/"bf16": cast; "int8"/"int4"/"int2": symmetric integers with one scale per
`block` elements, in `scales` (float32; bfloat16 for int2), int4 packed two to a byte, int2 (-1, 0
or 1) as a bitmap of the nonzero values and then their signs, a bit each); `compression` is "none" or "lz4"
(block format, size not stored: the receiver knows it). All numbers are little-endian. Nothing here
can execute code: a payload is checked against its header (sizes, dtype, codec) before any buffer
is allocated from it.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import lz4.block
import msgpack
import torch

from .errors import ProtocolError

if sys.byteorder != "little":  # the wire is little-endian and tensors are copied as they lie in memory
    raise ImportError("spheroid's wire codec supports little-endian hosts only")

EXT_TENSOR = 1
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = {"float32", "float16", "bfloat16"}
COMPRESSIONS = ("none", "lz4")
MAX_BLOCK = 4096  # a quantized tensor's block may be this long, or the tensor's length (decoding pads to whole blocks)
INT8_ERROR = 0.5 / 127  # int8's worst-case error, relative to the largest magnitude of a block
INT4_ERROR = 0.5 / 7
# int2 writes -1, 0 or 1 times a scale of INT2_MEAN_SCALE times the mean magnitude of a block of
# 256 values (or its largest, if smaller): values up to half the scale become 0, values beyond 1.5
# times it are clipped. It
# is meant for senders that carry what rounding lost into their next message (error feedback,
# tracked refreshes). A zero level matters there: a code without one (levels -3, -1, 1, 3, tried
# first) moves every value by at least a scale, so values that barely change get noise many times
# their change, and consecutive states of a block differ everywhere. A scale this wide, and small
# blocks, keep what the fastest values lose from growing round after round (tests/test_refresh.py).
# About 70% of the values are then 0: a bit per value saying which are not, and a sign bit for
# each that is not, take about 1.3 bits a value, where two bits each would take 2.
INT2_MEAN_SCALE = 2.5


class TensorCodec:
    """How a tensor's values travel in extension type 1: its `data`, and its `scales` and `block`
    where it has them. One subclass per codec, registered with `@register`; everything else (the
    frame codec, streams, the averaging, refreshes, the command line) looks codecs up by name."""

    name: ClassVar[str]  # in a tensor's header on the wire
    option: ClassVar[str] = ""  # in configs and on the command line (--codec, --refresh-codec); unset: `name`
    lossy: ClassVar[bool] = True  # what is decoded differs from what was encoded
    floats_only: ClassVar[bool] = True  # for floating-point tensors only
    scaled: ClassVar[bool] = False  # carries scales (one per `block` values); else `scales` is empty and `block` 0
    # averaging in it needs error feedback: without what it loses sent later, progress is lost
    needs_feedback: ClassVar[bool] = False
    # the codec a change of many rounds' worth goes in instead (what this one loses of it would take
    # rounds to send; None: this one)
    catch_up: ClassVar[str | None] = None

    def nbytes(self, itemsize: int, n: int) -> int:
        """Bytes of `data` (before compression) that hold n values of `itemsize` bytes, at most."""
        raise NotImplementedError

    def data_bytes(self, data: bytes | memoryview, itemsize: int, n: int) -> int:
        """Bytes `data` (decompressed) must hold for n values: `nbytes` unless its size depends on them."""
        return self.nbytes(itemsize, n)

    def encode(self, flat: torch.Tensor) -> tuple[bytes | memoryview, bytes, int]:
        """A flat CPU tensor's (data, scales, block): the data may be a view of its memory."""
        raise NotImplementedError

    def decode(self, data: bytes | memoryview, scales: bytes, block: int, n: int, dtype: torch.dtype
               ) -> torch.Tensor:
        """`encode`'s inverse: n values of `dtype` (`data` holds `data_bytes`; `scales` and `block` are
        as they came: ProtocolError unless they make sense)."""
        raise NotImplementedError


TENSOR_CODECS: dict[str, TensorCodec] = {}  # name on the wire -> codec, in the order they were registered
CODEC_OPTIONS: dict[str, TensorCodec] = {}  # name in configs and on the command line -> codec


def register(cls: type[TensorCodec]) -> type[TensorCodec]:
    """Add a codec to `TENSOR_CODECS` and `CODEC_OPTIONS`."""
    cls.option = cls.option or cls.name
    if cls.name in TENSOR_CODECS or cls.option in CODEC_OPTIONS:
        raise ValueError(f"a codec named {cls.name!r} or {cls.option!r} is registered already")
    TENSOR_CODECS[cls.name] = CODEC_OPTIONS[cls.option] = cls()
    return cls


@register
class Raw(TensorCodec):
    """The values as they lie in memory, in their own dtype (any dtype)."""

    name, option, lossy, floats_only = "raw", "fp32", False, False

    def nbytes(self, itemsize: int, n: int) -> int:
        return n * itemsize

    def encode(self, flat: torch.Tensor) -> tuple[memoryview, bytes, int]:
        return as_view(flat), b"", 0

    def decode(self, data: bytes | memoryview, scales: bytes, block: int, n: int, dtype: torch.dtype
               ) -> torch.Tensor:
        return from_bytes(data, dtype)


class Cast(TensorCodec):
    """The values cast to a 16-bit float type, and back to their dtype when decoded."""

    dtype: ClassVar[torch.dtype]

    def nbytes(self, itemsize: int, n: int) -> int:
        return n * self.dtype.itemsize

    def encode(self, flat: torch.Tensor) -> tuple[memoryview, bytes, int]:
        return as_view(flat.to(self.dtype)), b"", 0

    def decode(self, data: bytes | memoryview, scales: bytes, block: int, n: int, dtype: torch.dtype
               ) -> torch.Tensor:
        return from_bytes(data, self.dtype).to(dtype)


@register
class FP16(Cast):
    name, dtype = "fp16", torch.float16


@register
class BF16(Cast):
    name, dtype = "bf16", torch.bfloat16


class Quantized(TensorCodec):
    """Symmetric integers in [-top, top], one scale per `block` values: q = round(x / s), with
    s = max|x| / top (`scale`), or 1 for an all-zero block. The integers travel as `packed` lays
    them out (only this codec's packing is computed: int2's alone costs several times int8's whole
    encoding)."""

    scaled = True
    top: ClassVar[int]  # the largest integer it writes
    block: ClassVar[int]  # values per scale the encoder uses
    scale_dtype: ClassVar[torch.dtype] = torch.float32  # the scales' type on the wire
    data_dtype: ClassVar[torch.dtype] = torch.uint8  # `data` read as this before `unpacked`

    def scale(self, padded: torch.Tensor, n: int) -> torch.Tensor:
        """Each block's scale (before an all-zero block's becomes 1), from the values padded to whole blocks."""
        return padded.abs().amax(dim=1) / self.top

    def packed(self, q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def unpacked(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        raise NotImplementedError

    def quantize(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the integers, as int8; the scales, as float32) of float32 values."""
        n, block = flat.numel(), self.block
        padded = torch.nn.functional.pad(flat, (0, -n % block)).view(-1, block)
        scales = self.scale(padded, n)
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(padded / scales[:, None]).clamp(-self.top, self.top)
        return q.to(torch.int8).view(-1)[:n], scales.float()

    def encode(self, flat: torch.Tensor) -> tuple[memoryview, bytes, int]:
        q, s = self.quantize(flat.float())
        return as_view(self.packed(q)), as_bytes(s.to(self.scale_dtype)), self.block

    def decode(self, data: bytes | memoryview, scales: bytes, block: int, n: int, dtype: torch.dtype
               ) -> torch.Tensor:
        most = max(n, MAX_BLOCK)  # (decoding pads to whole blocks: a huge block would allocate it)
        n_scales = -(-n // block) if 0 < block <= most else -1
        if n_scales < 0 or len(scales) != self.scale_dtype.itemsize * n_scales:
            raise ProtocolError("bad_tensor", f"{self.name} needs 0 < block <= {most} and "
                                              f"{max(n_scales, 0)} {DTYPE_NAMES[self.scale_dtype]} scales")
        q = self.unpacked(from_bytes(data, self.data_dtype), n)
        return dequantize(q, from_bytes(scales, self.scale_dtype).float(), block).to(dtype)


@register
class Int8(Quantized):
    """A byte a value."""

    name, top, block, data_dtype = "int8", 127, 4096, torch.int8

    def nbytes(self, itemsize: int, n: int) -> int:
        return n

    def packed(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def unpacked(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        return raw


@register
class Int4(Quantized):
    """Two values a byte (`pack`)."""

    name, top, block, catch_up = "int4", 7, 4096, "int8"

    def nbytes(self, itemsize: int, n: int) -> int:
        return -(-n // 2)

    def packed(self, q: torch.Tensor) -> torch.Tensor:
        return pack(q, 4)

    def unpacked(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        return unpack(raw, n, 4)


@register
class Int2(Quantized):
    """-1, 0 or 1 times a scale of INT2_MEAN_SCALE times a block's mean magnitude, or its largest if
    smaller (a last partial block's mean over its own values), rounded toward zero to bfloat16: its
    scales are bfloat16, since at 256 values a block float32 scales would be 9% of its bytes (a rule
    of thumb, 2.5 times a mean: bfloat16's 3 digits lose nothing). Written as `ternary_pack` lays
    them out: its size depends on how many values are not 0, which its bitmap says.

    It zeroes values under 1.25 times its block's mean magnitude: averaging in it needs error
    feedback, or small steady progress would never reach the shared state."""

    name, top, block, scale_dtype, needs_feedback, catch_up = "int2", 1, 256, torch.bfloat16, True, "int8"

    def nbytes(self, itemsize: int, n: int) -> int:
        return 2 * -(-n // 8)  # (its bitmap, then a sign bit for each value, were none 0)

    def data_bytes(self, data: bytes | memoryview, itemsize: int, n: int) -> int:
        bitmap = -(-n // 8)
        return bitmap + -(-nonzero(from_bytes(data[:bitmap], torch.uint8), n) // 8)

    def scale(self, padded: torch.Tensor, n: int) -> torch.Tensor:
        counts = torch.full((padded.shape[0],), float(self.block))
        if n:
            counts[-1] = n - self.block * (padded.shape[0] - 1)
        # (at most the largest: a block of values all about the same size, or a last block of one
        # value, would otherwise round to zeros, and what error feedback owes them would too)
        scales = torch.minimum(INT2_MEAN_SCALE * (padded.abs().sum(dim=1) / counts), padded.abs().amax(dim=1))
        # as it travels: rounded toward zero to bfloat16 (its float32 bits but the upper 16), so that
        # it stays at most the largest value and finite
        return (scales.view(torch.int32) & ~0xFFFF).view(torch.float32)

    def packed(self, q: torch.Tensor) -> torch.Tensor:
        return ternary_pack(q)

    def unpacked(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        return ternary_unpack(raw, n)



@dataclass(frozen=True)
class Limits:
    """Bounds a decoder enforces before it allocates anything for a tensor. `max_bytes`: of the
    decoded tensor; a frame's decoder lowers it to what is left of the frame's share (a compressed
    int2 tensor of zeros is about 250 times smaller on the wire than decoded)."""

    max_elements: int = 1 << 28
    max_dims: int = 8
    max_bytes: int = 1 << 30


DEFAULT_LIMITS = Limits()

def encode_tensor(tensor: torch.Tensor, codec: str = "raw", compression: str = "none") -> bytes:
    """A tensor as the payload of extension type 1. lz4 is kept only if it shrinks the data."""
    return b"".join(encode_tensor_pieces(tensor, codec, compression))


def encode_tensor_pieces(tensor: torch.Tensor, codec: str = "raw", compression: str = "none"
                         ) -> list[bytes | memoryview]:
    """`encode_tensor`'s payload as pieces that join into it: the header, the data, the rest. A
    sender writes them one after the other, so the data is copied once, by the socket: without a
    codec the data piece is a view of the tensor's memory, which must not change until it is sent."""
    dtype = DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"dtype {tensor.dtype} cannot travel; use one of {sorted(DTYPES)}")
    if codec not in TENSOR_CODECS or compression not in COMPRESSIONS:
        raise ValueError(f"codec must be one of {tuple(TENSOR_CODECS)} and compression one of {COMPRESSIONS}")
    if TENSOR_CODECS[codec].floats_only and dtype not in FLOAT_DTYPES:
        raise ValueError(f"codec {codec} applies to floating-point tensors, not {dtype}")
    flat = tensor.detach().to("cpu").contiguous().view(-1)
    data, scales, block = TENSOR_CODECS[codec].encode(flat)
    if compression == "lz4":
        packed = lz4.block.compress(data, store_size=False)
        if len(packed) < len(data):
            data = packed
        else:
            compression = "none"
    # the same bytes as msgpack packing the seven fields: `data` is a bin, its header then itself
    packer = msgpack.Packer(autoreset=False)
    packer.pack_array_header(7)
    for value in (dtype, list(tensor.shape), codec, compression):
        packer.pack(value)
    head = packer.bytes() + bin_header(len(data))
    packer.reset()
    packer.pack(scales)
    packer.pack(block)
    return [head, data, packer.bytes()]


def bin_header(n: int) -> bytes:
    """msgpack's header of an n-byte bin, in its shortest form (as msgpack itself writes it)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


HEAD_BYTES = 256  # a tensor header's fields before `data` fit in this (8 dimensions of 9 bytes each at most)
BIN_LENGTH = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # msgpack's bin markers -> bytes of the length after them


def tensor_head(view: memoryview) -> tuple[list, int, int]:
    """A payload's first four fields (dtype, shape, codec, compression), and where its data starts
    and ends, read from its first bytes (`view`: the payload, or its start)."""
    head = msgpack.Unpacker(max_array_len=16, max_map_len=0, max_str_len=16, max_bin_len=0)
    head.feed(view[:HEAD_BYTES])
    try:
        if head.read_array_header() != 7:
            raise ValueError("not 7 fields")
        fields = [head.unpack() for _ in range(4)]
    except Exception as exc:
        raise ProtocolError("bad_tensor", "tensor header must be [dtype, shape, codec, compression, data, scales, "
                                          f"block] ({exc or 'cut short'})") from None
    at = head.tell()
    marker = view[at] if at < len(view) else None
    if marker not in BIN_LENGTH:
        raise ProtocolError("bad_tensor", "tensor data must be bin")
    start = at + 1 + BIN_LENGTH[marker]
    return fields, start, start + int.from_bytes(view[at + 1 : start], "big")


def tensor_tail(view: memoryview) -> tuple[Any, Any]:
    """A payload's last two fields (scales, block), from the bytes after its data."""
    tail = msgpack.Unpacker(max_array_len=0, max_map_len=0, max_str_len=0, max_bin_len=len(view))
    tail.feed(view)
    try:
        scales, block = tail.unpack(), tail.unpack()
    except Exception as exc:
        raise ProtocolError("bad_tensor", f"tensor scales and block are not msgpack: {exc or 'cut short'}") from None
    if tail.tell() != len(view):
        raise ProtocolError("bad_tensor", "bytes after the tensor's block field")
    return scales, block


def _fields(payload: bytes | memoryview) -> list:
    """The payload's seven fields, `data` as a view of the payload: a chunk's data is most of its
    frame, and msgpack would copy it (the frame's own bytes were already copied out of the frame)."""
    view = memoryview(payload)
    fields, start, end = tensor_head(view)
    if end > len(view):
        raise ProtocolError("bad_tensor", "tensor data runs past its payload")
    return [*fields, view[start:end], *tensor_tail(view[end:])]


def decode_tensor(payload: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> torch.Tensor:
    """Extension payload -> tensor, or ProtocolError naming what is wrong with it.

    A raw tensor shares the payload's memory (decoding copies nothing): clone it to write to it.
    """
    return decode_fields(*_fields(payload), limits)


def decode_fields(dtype: Any, shape: Any, codec: Any, compression: Any, data: bytes | memoryview, scales: Any,
                  block: Any, limits: Limits = DEFAULT_LIMITS) -> torch.Tensor:
    """`decode_tensor` of a payload's seven fields (a raw tensor over `data`'s memory). (The fields are
    as msgpack decoded them, so of exact types.)"""
    if not (type(dtype) is str and type(codec) is str and type(compression) is str):
        raise ProtocolError("bad_tensor", "dtype, codec and compression must be strings")
    if dtype not in DTYPES:
        raise ProtocolError("bad_tensor", f"unknown dtype {dtype!r}")
    if codec not in TENSOR_CODECS or compression not in COMPRESSIONS:
        raise ProtocolError("bad_tensor", f"unknown codec {codec!r} or compression {compression!r}")
    kind = TENSOR_CODECS[codec]
    if kind.floats_only and dtype not in FLOAT_DTYPES:
        raise ProtocolError("bad_tensor", f"codec {codec} is only for floating-point dtypes, not {dtype}")
    if (type(shape) is not list or len(shape) > limits.max_dims
            or not all(type(n) is int and n >= 0 for n in shape)):
        raise ProtocolError("bad_tensor", f"shape must be at most {limits.max_dims} non-negative integers")
    if type(scales) is not bytes or type(block) is not int:
        raise ProtocolError("bad_tensor", "scales must be bin, block an integer")
    if not kind.scaled and (scales or block):
        raise ProtocolError("bad_tensor", f"codec {codec} carries no scales: scales must be empty and block 0")
    numel = math.prod(shape)
    if numel > limits.max_elements:
        raise ProtocolError("too_large", f"tensor of {numel} elements exceeds the limit of {limits.max_elements}")
    if numel * DTYPES[dtype].itemsize > limits.max_bytes:
        raise ProtocolError("too_large", f"tensor of {numel} {dtype} decodes to more than the {limits.max_bytes} "
                                         "bytes a frame's tensors may take: send it as a stream of smaller chunks")
    expected = kind.nbytes(DTYPES[dtype].itemsize, numel)
    if compression == "lz4":
        try:
            data = lz4.block.decompress(data, uncompressed_size=expected)
        except lz4.block.LZ4BlockError as exc:
            raise ProtocolError("bad_tensor", f"lz4 data does not decompress to {expected} bytes: {exc}") from None
    expected = kind.data_bytes(data, DTYPES[dtype].itemsize, numel)
    if len(data) != expected:
        raise ProtocolError("bad_tensor", f"shape {shape} of {dtype}/{codec} needs {expected} bytes, got {len(data)}")
    return kind.decode(data, scales, block, numel, DTYPES[dtype]).view(shape)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 values of `bits` (4 or 1) bits' two's complement, 8 // bits to a byte, the first in the
    lowest bits: int4 puts value 2i in the low nibble of byte i and 2i + 1 in its high nibble; one
    bit puts value 8i + k in bit k of byte i (0 where there is no value)."""
    per = 8 // bits
    fields = torch.nn.functional.pad(q, (0, -q.numel() % per)).view(-1, per).to(torch.uint8) & ((1 << bits) - 1)
    out = fields[:, 0].clone()
    for k in range(1, per):
        out |= fields[:, k] << (bits * k)
    return out


def unpack(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """`pack`'s inverse: the first n values, as int8."""
    fields = torch.stack([(packed >> (bits * k)) & ((1 << bits) - 1) for k in range(8 // bits)], dim=1)
    sign = 1 << (bits - 1)
    return (fields.view(-1)[:n].to(torch.int8) ^ sign) - sign  # sign-extend


def ternary_pack(q: torch.Tensor) -> torch.Tensor:
    """int2's layout of values in {-1, 0, 1}: a bitmap, bit set where the value is not 0, then one
    bit for each value that is not 0, in order, set where it is -1."""
    nonzero = q != 0
    return torch.cat([pack(nonzero.to(torch.int8), 1), pack((q[nonzero] < 0).to(torch.int8), 1)])


def nonzero(bitmap: torch.Tensor, n: int) -> int:
    """How many of the first n bits of a bitmap are set."""
    return int(unpack(bitmap, n, 1).count_nonzero())


def ternary_unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`ternary_pack`'s inverse: n values in {-1, 0, 1}, as int8 (`packed` has been checked to hold
    exactly the bitmap and one sign bit for each value it sets)."""
    bitmap = -(-n // 8)
    nonzero = unpack(packed[:bitmap], n, 1) != 0
    negative = unpack(packed[bitmap:], int(nonzero.sum()), 1) != 0
    q = nonzero.to(torch.int8)
    q[nonzero] = torch.where(negative, -1, 1).to(torch.int8)
    return q


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    n = q.numel()
    padded = torch.nn.functional.pad(q.float(), (0, -n % block)).view(-1, block)
    return (padded * scales[:, None]).view(-1)[:n]


def as_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, not copied (little-endian, as `as_bytes`)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.contiguous().numpy()).cast("B")


def as_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous CPU tensor (little-endian: this module refuses big-endian hosts)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.contiguous().numpy().tobytes()


def from_bytes(data: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over `data`'s memory, not a copy of it (a received payload: nothing else holds it)."""
    if not data:
        return torch.empty(0, dtype=dtype)
    if isinstance(data, memoryview) and not data.readonly:  # (memory read in place: nothing for torch to warn of)
        return _tensor_over(data, dtype)
    with warnings.catch_warnings():  # (torch warns once that bytes are not writable)
        warnings.simplefilter("ignore", UserWarning)
        return _tensor_over(data, dtype)


def _tensor_over(data: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.frombuffer(data, dtype=torch.int16).view(torch.bfloat16)
    return torch.frombuffer(data, dtype=dtype)
