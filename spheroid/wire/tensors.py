"""Tensors on the wire: the msgpack extension type and its codecs (raw, fp16, bf16, int8, int4, int2; lz4 on top).

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
CODECS = ("raw", "fp16", "bf16", "int8", "int4", "int2")
COMPRESSIONS = ("none", "lz4")
QUANTIZED = {"int8": 127, "int4": 7, "int2": 1}  # codec -> the largest integer it writes (symmetric)
BLOCK = {"int8": 4096, "int4": 4096, "int2": 256}  # elements per scale the encoder uses
# the scales' type: int2's are bfloat16, since at 256 values a scale float32 scales would be 9% of
# its bytes (its scale is a rule of thumb, 2.5 times a mean: bfloat16's 3 digits lose nothing)
SCALE_DTYPE = {"int8": torch.float32, "int4": torch.float32, "int2": torch.bfloat16}
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


@dataclass(frozen=True)
class Limits:
    """Bounds a decoder enforces before it allocates anything for a tensor. `max_bytes`: of the
    decoded tensor; a frame's decoder lowers it to what is left of the frame's share (a compressed
    int2 tensor of zeros is about 250 times smaller on the wire than decoded)."""

    max_elements: int = 1 << 28
    max_dims: int = 8
    max_bytes: int = 1 << 30


DEFAULT_LIMITS = Limits()

def codec_nbytes(dtype: str, codec: str, n: int) -> int:
    """Bytes of `data` (before compression) that hold n values of dtype in codec; for int2 the most
    (its bitmap, then a sign bit for each value, were none 0)."""
    if codec == "raw":
        return n * DTYPES[dtype].itemsize
    if codec == "int4":
        return -(-n // 2)
    if codec == "int2":
        return 2 * -(-n // 8)
    return n * {"fp16": 2, "bf16": 2, "int8": 1}[codec]


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
    if codec not in CODECS or compression not in COMPRESSIONS:
        raise ValueError(f"codec must be one of {CODECS} and compression one of {COMPRESSIONS}")
    if codec != "raw" and dtype not in FLOAT_DTYPES:
        raise ValueError(f"codec {codec} applies to floating-point tensors, not {dtype}")
    flat = tensor.detach().to("cpu").contiguous().view(-1)
    scales, block = b"", 0
    if codec == "raw":
        data = as_view(flat)
    elif codec == "fp16":
        data = as_view(flat.to(torch.float16))
    elif codec == "bf16":
        data = as_view(flat.to(torch.bfloat16))
    else:
        block = BLOCK[codec]
        q, s = quantize(flat.float(), block, codec)
        packed = PACKERS[codec](q)
        data, scales = as_view(packed), as_bytes(s.to(SCALE_DTYPE[codec]))
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
    if codec not in CODECS or compression not in COMPRESSIONS:
        raise ProtocolError("bad_tensor", f"unknown codec {codec!r} or compression {compression!r}")
    if codec != "raw" and dtype not in FLOAT_DTYPES:
        raise ProtocolError("bad_tensor", f"codec {codec} is only for floating-point dtypes, not {dtype}")
    if (type(shape) is not list or len(shape) > limits.max_dims
            or not all(type(n) is int and n >= 0 for n in shape)):
        raise ProtocolError("bad_tensor", f"shape must be at most {limits.max_dims} non-negative integers")
    if type(scales) is not bytes or type(block) is not int:
        raise ProtocolError("bad_tensor", "scales must be bin, block an integer")
    if codec not in QUANTIZED and (scales or block):
        raise ProtocolError("bad_tensor", f"codec {codec} carries no scales: scales must be empty and block 0")
    numel = math.prod(shape)
    if numel > limits.max_elements:
        raise ProtocolError("too_large", f"tensor of {numel} elements exceeds the limit of {limits.max_elements}")
    if numel * DTYPES[dtype].itemsize > limits.max_bytes:
        raise ProtocolError("too_large", f"tensor of {numel} {dtype} decodes to more than the {limits.max_bytes} "
                                         "bytes a frame's tensors may take: send it as a stream of smaller chunks")
    expected = codec_nbytes(dtype, codec, numel)
    if compression == "lz4":
        try:
            data = lz4.block.decompress(data, uncompressed_size=expected)
        except lz4.block.LZ4BlockError as exc:
            raise ProtocolError("bad_tensor", f"lz4 data does not decompress to {expected} bytes: {exc}") from None
    if codec == "int2":  # (its size depends on how many values are not 0: its bitmap says)
        bitmap = -(-numel // 8)
        expected = bitmap + -(-nonzero(from_bytes(data[:bitmap], torch.uint8), numel) // 8)
    if len(data) != expected:
        raise ProtocolError("bad_tensor", f"shape {shape} of {dtype}/{codec} needs {expected} bytes, got {len(data)}")
    if codec == "raw":
        flat = from_bytes(data, DTYPES[dtype])
    elif codec in ("fp16", "bf16"):
        flat = from_bytes(data, torch.float16 if codec == "fp16" else torch.bfloat16).to(DTYPES[dtype])
    else:
        most = max(numel, BLOCK["int8"])  # (decoding pads to whole blocks: a huge block would allocate it)
        n_scales = -(-numel // block) if 0 < block <= most else -1
        scale_type = SCALE_DTYPE[codec]
        if n_scales < 0 or len(scales) != scale_type.itemsize * n_scales:
            raise ProtocolError("bad_tensor", f"{codec} needs 0 < block <= {most} and "
                                              f"{max(n_scales, 0)} {DTYPE_NAMES[scale_type]} scales")
        raw = from_bytes(data, torch.int8 if codec == "int8" else torch.uint8)
        q = UNPACKERS[codec](raw, numel)
        flat = dequantize(q, from_bytes(scales, scale_type).float(), block).to(DTYPES[dtype])
    return flat.view(shape)


def quantize(flat: torch.Tensor, block: int, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric integers with one scale per `block` elements: q = round(x / s) in [-top, top],
    s = max|x| / top (top = 127 for int8, 7 for int4), or for int2 (top 1)
    s = min(INT2_MEAN_SCALE mean|x|, max|x|) (a last partial block's mean over its own values)
    rounded toward zero to bfloat16; 1 for an all-zero block. The scales as float32."""
    n = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, -n % block)).view(-1, block)
    if codec == "int2":
        counts = torch.full((padded.shape[0],), float(block))
        if n:
            counts[-1] = n - block * (padded.shape[0] - 1)
        # (at most the largest: a block of values all about the same size, or a last block of one
        # value, would otherwise round to zeros, and what error feedback owes them would too)
        scales = torch.minimum(INT2_MEAN_SCALE * (padded.abs().sum(dim=1) / counts), padded.abs().amax(dim=1))
        # as it travels: rounded toward zero to bfloat16 (its float32 bits but the upper 16), so that
        # it stays at most the largest value and finite
        scales = (scales.view(torch.int32) & ~0xFFFF).view(torch.float32)
    else:
        scales = padded.abs().amax(dim=1) / QUANTIZED[codec]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    top = QUANTIZED[codec]
    q = torch.round(padded / scales[:, None]).clamp(-top, top)
    return q.to(torch.int8).view(-1)[:n], scales.float()


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


# each quantized codec's integers as they travel, and back: only the codec's own is computed (a
# table of the packed values themselves packed every tensor three ways, and int2's packing alone
# costs several times int8's whole encoding); the packers are looked up by name when called
PACKERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "int8": lambda q: q, "int4": lambda q: pack(q, 4), "int2": lambda q: ternary_pack(q)}
UNPACKERS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "int8": lambda raw, n: raw, "int4": lambda raw, n: unpack(raw, n, 4), "int2": lambda raw, n: ternary_unpack(raw, n)}


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
