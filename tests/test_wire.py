"""The sans-I/O codec: golden vectors both ways, round trips, limits, and every malformed-input class."""

import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch

from proto.make_vectors import from_json
from spheroid.wire import (
    SCHEMAS,
    Budget,
    Decoder,
    EncodedTensor,
    ProtocolError,
    Received,
    StreamAssembler,
    decode_body,
    decode_tensor,
    encode,
    encode_tensor,
    encode_tensor_pieces,
    stream_frames,
    through_codec,
)
from spheroid.wire.tensors import CODEC_OPTIONS, INT4_ERROR, INT8_ERROR, TENSOR_CODECS

VECTORS = Path(__file__).resolve().parents[1] / "proto" / "vectors"


def to_plain(value):
    """A decoded message in the vectors' JSON form (tensors as their values) for comparison."""
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                "values": value.reshape(-1).tolist()}
    if isinstance(value, bytes):
        return {"$bin": value.hex()}
    if isinstance(value, dict):
        if "$tensor" in value:
            t = value["$tensor"]
            return {"shape": t["shape"], "dtype": t["dtype"], "values": t["values"]}
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    return value


@pytest.mark.parametrize("path", sorted(VECTORS.glob("*.json")), ids=lambda p: p.stem)
def test_golden_vectors_both_ways(path):
    vector = json.loads(path.read_text())
    frame = bytes.fromhex(vector["frame"])
    assert encode(from_json(vector["message"])) == frame
    [(message, size, _)] = Decoder().feed(frame)
    assert size == len(frame)
    assert to_plain(message) == to_plain(vector["message"])


@pytest.mark.parametrize("path", sorted((VECTORS / "invalid").glob("*.json")), ids=lambda p: p.stem)
def test_invalid_vectors_raise_their_error_code(path):
    vector = json.loads(path.read_text())
    with pytest.raises(ProtocolError) as err:
        Decoder().feed(bytes.fromhex(vector["frame"]))
    assert err.value.code == vector["error"]


def test_every_message_type_has_a_vector():
    names = {json.loads(p.read_text())["message"]["t"] for p in VECTORS.glob("*.json")}
    assert names == set(SCHEMAS)


def test_decoder_takes_any_split_of_the_byte_stream():
    frames = b"".join(encode({"t": "ping", "id": i, "ts": float(i)}) for i in range(50))
    rng = random.Random(0)
    decoder, got, pos = Decoder(), [], 0
    while pos < len(frames):
        step = rng.randint(1, 9)
        got += [r.message["id"] for r in decoder.feed(frames[pos : pos + step])]
        pos += step
    assert got == list(range(50)) and decoder.buffered == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codec", ["raw", "fp16", "bf16", "int8", "int4", "int2"])
@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_tensor_round_trip_within_the_codecs_bound(dtype, codec, compression):
    t = (torch.randn(37, 129, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    back = decode_tensor(encode_tensor(t, codec, compression))
    assert back.dtype == dtype and back.shape == t.shape
    err = (back.float() - t.float()).abs()
    if codec == "raw":
        assert torch.equal(back, t)  # lossless
    elif codec in ("int8", "int4"):  # plus the rounding back to a 16-bit dtype, if that is what it was
        cast = {torch.float32: 0.0, torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype]
        bound = INT8_ERROR if codec == "int8" else INT4_ERROR
        assert (err <= bound * t.float().abs().max() * 1.001 + t.float().abs() * 2 * cast + 1e-6).all()
    elif codec == "int2":  # -1, 0 or 1 times 2.5 mean|x| per 256 values: off by at most half a scale unless clipped
        blocks = t.float().view(-1).split(256)
        scale = torch.cat([torch.full_like(b, min(2.5 * b.abs().mean().item(), b.abs().max().item()))
                           for b in blocks]).view(t.shape)
        scale = (scale.view(torch.int32) & ~0xFFFF).view(torch.float32)  # (scales travel as bf16, cut toward zero)
        expected = (t.float() / scale).round().clamp(-1, 1) * scale
        cast = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
        assert torch.allclose(back.float(), expected, rtol=cast, atol=1e-5)
        inside = t.float().abs() <= 1.5 * scale
        assert (err[inside] <= scale[inside] * (0.5 + 2 * cast) + 1e-5).all()
    else:  # a cast: half an ulp of the narrower type
        eps = {"fp16": 2**-11, "bf16": 2**-8}[codec]
        assert (err <= t.float().abs() * eps * 1.001 + 1e-6).all()


@pytest.mark.parametrize("name", list(TENSOR_CODECS))
def test_every_registered_codec_keeps_what_its_class_says(name):
    """What the rest of the code reads of a codec (spheroid.wire.tensors): a lossless one gives back the
    very values, its data takes at most `nbytes`, it carries scales if it says so, it is found by its
    config name too, and its `catch_up` is a codec."""
    codec = TENSOR_CODECS[name]
    t = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    dtype, shape, wire, compression, data, scales, block = msgpack.unpackb(encode_tensor(t, name))
    assert wire == name and len(data) <= codec.nbytes(4, t.numel())
    assert (block > 0) == (len(scales) > 0) == codec.scaled
    assert torch.equal(decode_tensor(encode_tensor(t, name)), t) == (not codec.lossy)
    assert CODEC_OPTIONS[codec.option] is codec and (codec.catch_up is None or codec.catch_up in TENSOR_CODECS)


def test_int2_sends_values_of_one_size_and_a_lone_last_value():
    """Its scale is at most the block's largest value: a block of values of about one size (2.5 times
    their mean would zero them all) and a last block of one value come through."""
    for t in (torch.full((256,), 0.01), torch.tensor([0.3]), torch.tensor([6e4, 2e4], dtype=torch.float16),
              torch.full((4,), 65504.0, dtype=torch.float16), torch.full((3,), 3.4e38)):  # (largest: still finite)
        back = decode_tensor(encode_tensor(t, "int2"))
        assert torch.isfinite(back).all() and (back.float().abs() > 0).any()
        assert back.float().abs().max() <= t.float().abs().max() * 1.001


def test_int2_takes_a_bit_per_value_and_a_sign_bit_per_value_not_zero():
    """On normal data about 70% of int2's values are 0, so a bitmap and the signs beat two bits a
    value; data whose length does not match its bitmap is refused."""
    t = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1))
    dtype, shape, codec, compression, data, scales, block = msgpack.unpackb(encode_tensor(t, "int2"))
    nonzero = int((decode_tensor(encode_tensor(t, "int2")) != 0).sum())
    assert len(data) == len(t) // 8 + -(-nonzero // 8) < 0.17 * len(t)  # (two bits a value: 0.25 bytes)
    for wrong in (data[:-1], data + b"\x00", data[: len(t) // 8]):
        with pytest.raises(ProtocolError, match="needs"):
            decode_tensor(msgpack.packb([dtype, shape, codec, compression, wrong, scales, block]))


def test_integer_tensors_travel_raw_only():
    t = torch.arange(10, dtype=torch.int64)
    assert torch.equal(decode_tensor(encode_tensor(t, "raw", "lz4")), t)
    with pytest.raises(ValueError, match="floating-point"):
        encode_tensor(t, "fp16")


def test_lz4_is_used_only_when_it_shrinks():
    zeros = msgpack.unpackb(encode_tensor(torch.zeros(4096), "raw", "lz4"))
    noise = msgpack.unpackb(encode_tensor(torch.randn(4096), "raw", "lz4"))
    assert zeros[3] == "lz4" and len(zeros[4]) < 1000
    assert noise[3] == "none" and len(noise[4]) == 4 * 4096


@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_large_tensor_streams_in_bounded_chunks(codec):
    t = torch.randn(3, 1000, 1000)
    ids = itertools.count()
    frames = list(stream_frames(t, 5, lambda: next(ids), codec, "lz4", chunk_size=1 << 20))
    assert all(len(out.frame) <= (1 << 20) + 256 for out in frames)
    assert len(frames) == 1 + 12  # 12 MB of float32 in 1 MiB chunks
    decoder, streams = Decoder(), StreamAssembler(budget=t.numel() * 4)
    for out in frames:
        for msg, *_ in decoder.feed(out.frame):
            (streams.begin if msg["t"] == "stream_begin" else streams.chunk)(msg)
    back = streams.take(5)
    assert back.shape == t.shape and streams.held == 0
    if codec == "raw":
        assert torch.equal(back, t)
    else:
        assert (back - t).abs().max() <= INT8_ERROR * t.abs().max() * 1.001


def test_a_chunk_decodes_alike_in_place_and_through_msgpack_in_any_layout():
    """A chunk as spheroid lays it out is decoded from the frame's bytes; the same chunk with its
    entries in another order goes through msgpack; both give the same message, and a bad tensor in
    either is refused with the same error."""
    t = torch.randn(70_000)
    [_, out] = stream_frames(t, 3, lambda: 9)
    body = out.frame[4:]
    message = msgpack.unpackb(body, ext_hook=lambda code, data: msgpack.ExtType(code, data))
    rest = {k: v for k, v in message.items() if k != "data"}
    reordered = msgpack.packb({"data": message["data"], **rest})
    for frame_body in (body, bytearray(body), reordered):
        got = decode_body(frame_body)
        assert {k: v for k, v in got.items() if k != "data"} == rest == {"t": "stream_chunk", "id": 9, "stream": 3,
                                                                         "seq": 0}
        assert torch.equal(got["data"], t)
    fields = msgpack.unpackb(message["data"].data)
    wrong = msgpack.ExtType(1, msgpack.packb([fields[0], [70_001], *fields[2:]]))  # one value more than its data
    for bad in (msgpack.packb({**message, "data": wrong}), msgpack.packb({"data": wrong, **rest})):
        with pytest.raises(ProtocolError, match="needs 280004 bytes, got 280000"):
            decode_body(bad)


def read_in_pieces(decoder: Decoder, data: bytes, rng: random.Random) -> Iterator[Received]:
    """`data` read into the decoder's buffers as a socket would, in reads of random sizes; each
    message as it completes."""
    pos = 0
    while pos < len(data):
        with decoder.get_buffer() as buffer:
            n = min(len(buffer), rng.choice([1, 7, 300, 4096, 1 << 16, 1 << 20]), len(data) - pos)
            buffer[:n] = data[pos : pos + n]
        decoder.buffer_updated(n)
        pos += n
        while (received := decoder.next_message()) is not None:
            yield received


def test_reading_into_the_decoders_buffer_gives_the_same_messages_as_feeding_it():
    """Large frames are read straight into a buffer of their own, small ones into a scratch buffer;
    any split of the byte stream between reads gives the same messages."""
    ids = itertools.count()
    frames = b"".join(out.frame for out in stream_frames(torch.randn(300_000), 1, lambda: next(ids),
                                                          chunk_size=1 << 18))
    frames += encode({"t": "ping", "id": 99, "ts": 1.5}) * 3
    expected = [m for m, *_ in Decoder().feed(frames)]
    rng = random.Random(0)
    for _ in range(5):
        decoder = Decoder()
        got = [received.message for received in read_in_pieces(decoder, frames, rng)]
        assert len(got) == len(expected) == 1 + 5 + 3 and decoder.buffered == 0
        for a, b in zip(got, expected, strict=True):
            assert a.keys() == b.keys() and all(
                torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_a_raw_chunks_data_is_read_straight_into_its_streams_tensor():
    """With a session's streams as its `place`, a decoder reads a raw chunk's data into its place in
    the stream's tensor, whatever the split of reads; other chunks (a lossy codec's) are decoded as
    usual, and so is a chunk that is not its stream's next or has bad bytes after its data."""
    ids = itertools.count()
    t = torch.randn(300_000)
    raw = [out.frame for out in stream_frames(t, 1, lambda: next(ids), chunk_size=1 << 18)]
    lossy = [out.frame for out in stream_frames(t, 2, lambda: next(ids), "int8", chunk_size=1 << 18)]
    data = b"".join(raw + lossy)
    rng = random.Random(1)
    for _ in range(4):
        streams = StreamAssembler()
        decoder, placed = Decoder(place=streams.destination), []
        for received in read_in_pieces(decoder, data, rng):
            if received.message["t"] == "stream_begin":
                streams.begin(received.message)
            else:
                placed.append((received.message["stream"], received.body == b""))  # (no body: in place)
                streams.chunk(received.message)
        assert placed == [(1, True)] * 5 + [(2, False)] * 5 and decoder.buffered == 0
        assert torch.equal(streams.take(1), t)
        assert torch.equal(streams.take(2), through_codec(t, "int8", chunk_size=1 << 18))
    streams = StreamAssembler()
    decoder = Decoder(place=streams.destination)
    streams.begin(decoder.feed(raw[0])[0].message)
    with pytest.raises(ProtocolError, match="chunk 1 arrived, 0 expected"):
        streams.chunk(decoder.feed(raw[2])[0].message)
    bad = raw[1][:-1] + b"\x05"  # its block field: a raw tensor has none
    for in_place in (False, True):
        streams = StreamAssembler()
        decoder = Decoder(place=streams.destination if in_place else None)
        streams.begin(decoder.feed(raw[0])[0].message)
        with pytest.raises(ProtocolError, match="carries no scales"):
            decoder.feed(bad)


def test_a_quantized_codec_packs_with_its_own_packer_only(monkeypatch):
    """int8 needs no packing and int4 no ternary code: encoding with one never runs another codec's
    packer (an eager table of all three once made int8 encoding several times slower)."""
    from spheroid.wire import tensors

    t = torch.randn(10_000)

    def refuse(*args):
        raise AssertionError("another codec's packer ran")

    int4_pack = tensors.pack
    monkeypatch.setattr(tensors, "ternary_pack", refuse)
    monkeypatch.setattr(tensors, "pack", refuse)
    back = decode_tensor(encode_tensor(t, "int8"))
    assert (back - t).abs().max() <= INT8_ERROR * t.abs().max() * 1.001
    monkeypatch.setattr(tensors, "pack", int4_pack)
    back = decode_tensor(encode_tensor(t, "int4"))
    assert (back - t).abs().max() <= INT4_ERROR * t.abs().max() * 1.001


def test_a_chunk_whose_data_length_lies_is_never_read_into_place():
    """The data length inside a raw chunk's tensor is the peer's word: one that runs past the frame
    (or leaves more bytes after the data than a tensor's last fields take) must not decide where
    bytes are written. Such a frame is decoded as usual, which refuses it; the placer is never asked,
    whatever the split of reads."""
    [_, out] = stream_frames(torch.randn(70_000, generator=torch.Generator().manual_seed(0)), 3, lambda: 9)
    frame = out.frame
    length = (70_000 * 4).to_bytes(4, "big")
    at = frame.index(b"\xc6" + length) + 1  # the data's bin32 length
    asked = []

    def place(message: dict, key: str, dtype: str, nbytes: int) -> memoryview:
        asked.append(nbytes)
        return memoryview(bytearray(nbytes))

    # (too short: its last 64 bytes and its scales and block are read as the scales and block)
    for claimed, error in ((70_000 * 4 + 8, "runs past its payload"), (70_000 * 4 - 64, "scales and block")):
        lying = frame[:at] + claimed.to_bytes(4, "big") + frame[at + 4 :]
        for seed in range(3):
            decoder = Decoder(place=place)
            with pytest.raises(ProtocolError, match=error):
                list(read_in_pieces(decoder, lying, random.Random(seed)))
    assert asked == []
    assert [r.message["seq"] for r in read_in_pieces(Decoder(place=place), frame, random.Random(0))] == [0]
    assert asked == [70_000 * 4]  # (the honest chunk, for contrast)


def test_a_large_frames_own_buffer_comes_out_of_the_budget_and_goes_back():
    """A large frame's body buffer is reserved from the process's budget once its header is in, and
    returned when the frame is decoded or dropped; without room in the budget the frame still
    arrives, through the scratch buffer."""
    ids = itertools.count()
    [_, chunk] = [out.frame for out in stream_frames(torch.randn(100_000), 1, lambda: next(ids))]
    for limit, reserved in ((1 << 20, len(chunk) - 4), (1 << 10, 0)):
        budget = Budget(limit)
        decoder = Decoder(budget=budget)
        decoder.receive(chunk[:1000])
        assert decoder.next_message() is None and budget.held == reserved
        decoder.receive(chunk[1000:])
        assert decoder.next_message().message["t"] == "stream_chunk" and budget.held == 0
        decoder.receive(chunk[:1000])
        decoder.next_message()
        decoder.clear()
        assert budget.held == 0 and decoder.buffered == 0


def test_stream_over_budget_or_out_of_order_is_refused():
    ids = itertools.count()
    frames = [out.frame for out in stream_frames(torch.zeros(1000), 1, lambda: next(ids), chunk_size=1024)]
    with pytest.raises(ProtocolError, match="budget"):
        StreamAssembler(budget=100).begin(Decoder().feed(frames[0])[0].message)
    streams, decoder = StreamAssembler(), Decoder()
    streams.begin(decoder.feed(frames[0])[0].message)
    with pytest.raises(ProtocolError, match="chunk 1 arrived, 0 expected"):
        streams.chunk(decoder.feed(frames[2])[0].message)


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def _tensor_ext(obj):
    return msgpack.ExtType(1, encode_tensor(obj))


MALFORMED = {
    "oversized length": (b"\x7f\xff\xff\xff", "too_large"),
    "zero length": (b"\x00\x00\x00\x00", "bad_frame"),
    "non-map body": (frame(msgpack.packb([1, 2])), "bad_message"),
    "garbage body": (frame(b"\xc1\xc1\xc1"), "bad_msgpack"),
    "trailing bytes": (frame(msgpack.packb({"t": "peers", "id": 1}) + b"\x00"), "bad_frame"),
    "unknown type": (frame(msgpack.packb({"t": "format_disk", "id": 1})), "unknown_type"),
    "missing field": (frame(msgpack.packb({"t": "ping", "id": 1})), "bad_field"),
    "wrong field type": (frame(msgpack.packb({"t": "hello", "id": 1, "version": "1"})), "bad_field"),
    "negative id": (frame(msgpack.packb({"t": "peers", "id": -1})), "bad_field"),
    "deep nesting": (frame(b"\x82\xa1t\xa4ping\xa1x" + b"\x91" * 5000 + b"\x00"), "too_deep"),
    "unknown extension": (frame(msgpack.packb({"t": "peers", "id": 1, "x": msgpack.ExtType(42, b"")})),
                          "unknown_ext"),
    "bad tensor header": (frame(msgpack.packb({"t": "peers", "id": 1, "x": msgpack.ExtType(1, b"\x92\x01\x02")})),
                          "bad_tensor"),
    "shape/bytes mismatch": (frame(msgpack.packb({"t": "peers", "id": 1, "x": msgpack.ExtType(
        1, msgpack.packb(["float32", [10], "raw", "none", b"\x00" * 8, b"", 0]))})), "bad_tensor"),
    "unknown dtype": (frame(msgpack.packb({"t": "peers", "id": 1, "x": msgpack.ExtType(
        1, msgpack.packb(["object", [1], "raw", "none", b"\x00" * 8, b"", 0]))})), "bad_tensor"),
    "huge shape": (frame(msgpack.packb({"t": "peers", "id": 1, "x": msgpack.ExtType(
        1, msgpack.packb(["float32", [1 << 20, 1 << 20], "raw", "none", b"", b"", 0]))})), "too_large"),
    "lz4 bomb": (frame(msgpack.packb({"t": "peers", "id": 1, "x": msgpack.ExtType(
        1, msgpack.packb(["float32", [4], "raw", "lz4", b"\xff" * 40, b"", 0]))})), "bad_tensor"),
    "a block that would pad the tensor out": (frame(msgpack.packb({"t": "peers", "id": 1, "x": msgpack.ExtType(
        1, msgpack.packb(["float32", [1], "int8", "none", b"\x01", b"\0" * 4, 1 << 25]))})), "bad_tensor"),
    # stream chunks as spheroid lays them out (decoded from the frame's own bytes): the same errors
    "chunk with a list for its dtype": (frame(msgpack.packb({"t": "stream_chunk", "id": 1, "stream": 1, "seq": 0,
        "data": msgpack.ExtType(1, msgpack.packb([[1], [100], "raw", "none", b"\0" * 400, b"", 0]))})),
        "bad_tensor"),
    "chunk cut at its extension's marker": (frame(
        b"\x85" + b"".join(map(msgpack.packb, ["t", "stream_chunk", "id", 1, "stream", 1, "x", "a" * 219, "data"]))
        + b"\xc9"), "bad_msgpack"),
    # extension -1, msgpack's timestamp (which msgpack decodes itself, never asking for an ext_hook), in
    # each of its lengths and in one it has not
    **{f"timestamp extension of {len(data)} bytes": (frame(b"\x83" + b"".join(map(msgpack.packb, [
        "t", "peers", "id", 1, "x"])) + head + b"\xff" + data), "unknown_ext")
       for head, data in ((b"\xd6", b"\0" * 4), (b"\xd7", b"\0" * 8), (b"\xc7\x0c", b"\0" * 12), (b"\xd4", b"\0"))},
    "timestamp among a chunk's fields": (frame(msgpack.packb({"t": "stream_chunk", "id": 1, "stream": 1, "seq": 0,
        "x": msgpack.Timestamp(1, 0), "data": torch.zeros(4)}, default=_tensor_ext)), "unknown_ext"),
    # map keys are str (section 1.2), at any depth, and in a chunk read from its own bytes too
    "bin map key": (frame(msgpack.packb({"t": "status_reply", "id": 2, "re": 1, "status": {b"k": 1}})), "bad_msgpack"),
    "bin key among a chunk's fields": (frame(msgpack.packb({"t": "stream_chunk", "id": 1, "stream": 1, "seq": 0,
        b"x": 1, "data": torch.zeros(4)}, default=_tensor_ext)), "bad_msgpack"),
    "integer key among a chunk's fields": (frame(msgpack.packb({"t": "stream_chunk", "id": 1, "stream": 1, "seq": 0,
        7: 1, "data": torch.zeros(4)}, default=_tensor_ext, strict_types=False)), "bad_msgpack"),
    # the body's faults come before the message's: a bad tensor in a field that takes none is bad_tensor
    "bad tensor last, in a field that takes none": (frame(msgpack.packb({"t": "stream_chunk", "id": 1, "stream": 1,
        "seq": 0, "data": torch.zeros(4), "x": msgpack.ExtType(1, msgpack.packb(
            ["float32", [4], "raw", "none", b"\0" * 12, b"", 0]))}, default=_tensor_ext)), "bad_tensor"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_every_malformed_input_class_is_a_protocol_error(name):
    data, code = MALFORMED[name]
    decoder = Decoder()
    with pytest.raises(ProtocolError) as err:
        decoder.feed(data)
    assert err.value.code == code
    with pytest.raises(ProtocolError) as again:  # dead from then on
        decoder.feed(encode({"t": "peers", "id": 2}))
    assert again.value.code == code


def test_messages_before_a_bad_frame_come_out_first_then_the_error():
    decoder = Decoder()
    data = encode({"t": "status", "id": 1}) + encode({"t": "peers", "id": 2}) + encode({"t": "nonsense", "id": 3})
    assert [r.message["t"] for r in decoder.feed(data)] == ["status", "peers"]
    assert decoder.error is not None and decoder.error.code == "unknown_type"
    with pytest.raises(ProtocolError, match="unknown message type"):
        decoder.feed(b"")


def test_truncated_frame_waits_and_never_yields():
    data = encode({"t": "status", "id": 1})
    decoder = Decoder()
    assert decoder.feed(data[:-1]) == [] and decoder.buffered == len(data) - 1


def test_encoder_refuses_what_cannot_travel():
    with pytest.raises(TypeError, match="cannot send"):
        encode({"t": "ping", "id": 1, "ts": object()})
    with pytest.raises(ValueError, match="frame limit"):
        encode({"t": "status_reply", "id": 1, "status": {"x": b"\x00" * (5 << 20)}})


def test_nesting_limit_is_the_one_the_spec_states():
    """PROTOCOL.md, section 1: 1,024 nested containers, the message's own map included."""
    def body(containers: int) -> bytes:  # the map {t, id, ts, x}, x nested arrays around a 0
        return b"\x84\xa1t\xa4ping\xa2id\x01\xa2ts\x01\xa1x" + b"\x91" * (containers - 1) + b"\x00"

    assert decode_body(body(1024))["t"] == "ping"
    with pytest.raises(ProtocolError) as err:
        decode_body(body(1025))
    assert err.value.code == "too_deep"



def test_rules_the_spec_states_are_enforced():
    """A chunk must be 1-D (section 4); a codec other than int8 carries no scales (section 3)."""
    import msgpack

    streams = StreamAssembler()
    streams.begin({"t": "stream_begin", "id": 1, "stream": 1, "dtype": "float32", "shape": [4], "chunks": 1,
                   "chunk_elems": 4})
    with pytest.raises(ProtocolError) as err:
        streams.chunk({"t": "stream_chunk", "id": 2, "stream": 1, "seq": 0, "data": torch.zeros(2, 2)})
    assert err.value.code == "bad_stream"
    payload = msgpack.packb(["float32", [1], "raw", "none", b"\0" * 4, b"\0" * 4, 1])
    with pytest.raises(ProtocolError) as err:
        decode_tensor(payload)
    assert err.value.code == "bad_tensor" and "carries no scales" in err.value.message


def test_a_frames_tensors_decode_to_no_more_than_the_frame_limit():
    """2^20 zeros in int2 + lz4 take 9 KiB on the wire (their scales, mostly) and 4 MiB decoded: after the handshake
    (4 MiB frames) a stream chunk of them decodes; in a hello (64 KiB frames) a tensor is refused
    before anything is allocated for it, and so is one in a field that takes none."""
    zeros = EncodedTensor(encode_tensor_pieces(torch.zeros(1 << 20), "int2", "lz4"))
    chunk = encode({"t": "stream_chunk", "id": 1, "stream": 1, "seq": 0, "data": zeros})
    assert len(chunk) < 10_000 and decode_body(chunk[4:])["data"].numel() == 1 << 20
    with pytest.raises(ProtocolError, match="decodes to more than the 65536 bytes") as err:
        decode_body(chunk[4:], max_frame=64 << 10)
    assert err.value.code == "too_large"
    hello = encode({"t": "hello", "id": 1, "version": 11, "swarm": "s", "node": "ab" * 16, "addr": "", "role": "client",
                    "blocks": [], "nonce": b"n" * 16, "auth": False, "boot": b"b" * 8, "x": [zeros, zeros]})
    with pytest.raises(ProtocolError, match="decodes to more than the 65536 bytes"):
        decode_body(hello[4:], max_frame=64 << 10)
    small = torch.zeros(4)
    ping = encode({"t": "ping", "id": 2, "ts": 0.0, "x": small})
    with pytest.raises(ProtocolError, match="ping: a tensor in a field that takes none") as err:
        decode_body(ping[4:])
    assert err.value.code == "bad_field"


def test_one_connection_holds_at_most_sixteen_streams_and_half_a_shared_budget():
    ids = itertools.count()

    def begin(numel: int, stream: int) -> dict:
        return Decoder().feed(next(stream_frames(torch.zeros(numel), stream, lambda: next(ids))).frame)[0].message

    budget = Budget(1 << 20)
    streams = StreamAssembler(budget)
    for stream in range(16):  # (empty streams reserve no bytes, but count)
        streams.begin(begin(0, stream))
    with pytest.raises(ProtocolError, match="16 streams are already open") as err:
        streams.begin(begin(0, 16))
    assert err.value.code == "too_many_streams"
    streams.take(3)
    streams.begin(begin(0, 16))  # (one taken: room for one more)
    other = StreamAssembler(budget)
    other.begin(begin((1 << 18) // 2, 1))  # half the budget (float32): the most one connection holds
    with pytest.raises(ProtocolError, match="on one connection"):
        other.begin(begin(1, 2))
    assert budget.held == 1 << 19
    StreamAssembler(budget).begin(begin((1 << 18) // 2, 1))  # another connection takes the other half
    asking = StreamAssembler(budget := Budget(1 << 20))
    asking.asked = 1  # a state this side asked for may take the whole budget
    asking.begin(begin((3 << 18) // 4, 1))
    assert budget.held == 3 << 18


def test_a_large_frame_read_into_its_own_buffer_is_checked_alike():
    """A frame over 64 KiB is read into a buffer of its own (a memoryview): its timestamp and bin keys are
    refused as in a small one."""
    pad = b"p" * (100 << 10)
    for extra, code in (({"x": msgpack.Timestamp(1, 0)}, "unknown_ext"), ({"x": {b"k": 1}}, "bad_msgpack")):
        body = msgpack.packb({"t": "status_reply", "id": 2, "re": 1, "status": {"pad": pad, **extra}})
        with pytest.raises(ProtocolError) as err:
            Decoder().feed(frame(body))
        assert err.value.code == code
        with pytest.raises(ProtocolError) as err:
            decode_body(memoryview(body))
        assert err.value.code == code
