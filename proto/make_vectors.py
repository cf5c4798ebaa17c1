"""Writes the golden vectors in proto/vectors/ from the reference codec (python proto/make_vectors.py).

Each vector is NAME.json: {"frame": hex of the whole frame, "message": the message as JSON}, where
bytes are {"$bin": hex} and a tensor is {"$tensor": {dtype, shape, codec, compression, values}}
with `values` the decoded values, flattened. Encoding the message with the tensor's codec must give
`frame` exactly; decoding `frame` must give `message`. The rounding vectors also give `input`, the
float32 values before encoding (whose rounding to int8, bf16 or fp16 the frame fixes): encode
`input`, not `values`. Invalid frames go to vectors/invalid/ with the
error code a decoder must raise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from spheroid.averaging import group_digest
from spheroid.wire import EncodedTensor, decode_body, encode, encode_tensor_pieces

HERE = Path(__file__).parent / "vectors"


def to_json(value):
    if isinstance(value, bytes):
        return {"$bin": value.hex()}
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value


def from_json(value):
    """JSON -> message, tensors as EncodedTensor with the vector's codec (so encoding is exact)."""
    if isinstance(value, dict) and "$bin" in value:
        return bytes.fromhex(value["$bin"])
    if isinstance(value, dict) and "$tensor" in value:
        t = value["$tensor"]
        dtype = getattr(torch, t["dtype"])
        tensor = torch.tensor(t.get("input", t["values"]), dtype=torch.float64).to(dtype).view(t["shape"])
        return EncodedTensor(encode_tensor_pieces(tensor, t["codec"], t["compression"]))
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def with_decoded_values(message, decoded):
    """The vector's message with every tensor's values replaced by what decoding gives."""
    if isinstance(message, dict) and "$tensor" in message:
        return {"$tensor": {**message["$tensor"], "values": decoded.reshape(-1).tolist()}}  # "input" stays
    if isinstance(message, dict) and "$bin" not in message:
        return {k: with_decoded_values(v, decoded[k]) for k, v in message.items()}
    if isinstance(message, list):
        return [with_decoded_values(m, d) for m, d in zip(message, decoded, strict=True)]
    return message


def tensor_json(values, shape, dtype="float32", codec="raw", compression="none", rounded=False):
    """A tensor of the vectors; `rounded`: `values` are the input, kept as `input` beside what decodes."""
    return {"$tensor": {"dtype": dtype, "shape": shape, "codec": codec, "compression": compression,
                        "values": values, **({"input": values} if rounded else {})}}


VALID = {
    "hello": {"t": "hello", "id": 1, "version": 7, "swarm": "spheroid", "node": "0f" * 16,
              "addr": "10.0.0.1:7400", "role": "worker", "blocks": [2], "nonce": {"$bin": "a5" * 16},
              "auth": True, "boot": {"$bin": "01" * 8}},
    "auth": {"t": "auth", "id": 2, "mac": {"$bin": "5c" * 32}},
    "ping": {"t": "ping", "id": 3, "ts": 12.5},
    "pong": {"t": "pong", "id": 9, "re": 3, "ts": 12.5},
    "peers": {"t": "peers", "id": 4},
    "peers_reply": {"t": "peers_reply", "id": 10, "re": 4, "peers": [
        {"node": "1e" * 16, "addr": "10.0.0.2:7400", "role": "worker", "blocks": [0, 1]}]},
    "status": {"t": "status", "id": 5},
    "status_reply": {"t": "status_reply", "id": 11, "re": 5, "status": {"node": "0f" * 16, "peers": []}},
    "error": {"t": "error", "id": 6, "code": "swarm", "message": "swarm 'x' is not 'spheroid'"},
    "bye": {"t": "bye", "id": 7, "reason": "shutdown"},
    "stream_begin": {"t": "stream_begin", "id": 12, "stream": 1, "dtype": "float32", "shape": [2, 3],
                     "chunks": 2, "chunk_elems": 4},
    "stream_chunk_raw": {"t": "stream_chunk", "id": 13, "stream": 1, "seq": 0,
                         "data": tensor_json([1.0, -2.5, 0.25, 3.0], [4])},
    "stream_chunk_fp16": {"t": "stream_chunk", "id": 14, "stream": 1, "seq": 1,
                          "data": tensor_json([0.5, -1.75], [2], codec="fp16")},
    "stream_chunk_bf16": {"t": "stream_chunk", "id": 15, "stream": 2, "seq": 0,
                          "data": tensor_json([1.0, 2.0, -0.5], [3], codec="bf16")},
    "stream_chunk_int8": {"t": "stream_chunk", "id": 16, "stream": 3, "seq": 0,
                          "data": tensor_json([1.0, -0.5, 0.0, 0.25], [4], codec="int8")},
    "stream_chunk_lz4": {"t": "stream_chunk", "id": 17, "stream": 4, "seq": 0,
                         "data": tensor_json([0.0] * 256, [256], compression="lz4")},
    # rounding: int8 ties to even (scale = 127 / 127 = 1), bf16 and fp16 to nearest, ties to even
    "int8_rounding": {"t": "stream_chunk", "id": 33, "stream": 3, "seq": 1, "data": tensor_json(
        [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.6, -127.0], [8], codec="int8", rounded=True)},
    "int8_zero_block": {"t": "stream_chunk", "id": 34, "stream": 3, "seq": 2, "data": tensor_json(
        [0.0, 0.0, 0.0], [3], codec="int8", rounded=True)},
    # int4: scale = 7 / 7 = 1, ties to even, two values a byte (low nibble first), an odd count's
    # last high nibble 0
    "int4_rounding": {"t": "stream_chunk", "id": 38, "stream": 3, "seq": 3, "data": tensor_json(
        [7.0, 0.5, 1.5, 2.5, -0.5, -1.5, 6.6, -7.0, 3.5], [9], codec="int4", rounded=True)},
    # int2: scale = 2.5 * mean|x| = 2.5 * 8 / 8 = 2.5 (up to rounding); q = round(x / 2.5) in [-1, 1]:
    # 0.5 to 0, 1.5 to 1, -1.5 to -1, 4.0 clips to 1; a bitmap of the values not 0 (0b00010110),
    # then their signs (0b010: the second of them is -1)
    "int2_rounding": {"t": "stream_chunk", "id": 39, "stream": 3, "seq": 4, "data": tensor_json(
        [0.5, 1.5, -1.5, -0.2, 4.0, 0.0, 0.2, 0.1], [8], codec="int2", rounded=True)},
    "bf16_rounding": {"t": "stream_chunk", "id": 35, "stream": 2, "seq": 1, "data": tensor_json(
        [1.00390625, 1.01171875, 1.0039072036743164, -1.00390625], [4], codec="bf16", rounded=True)},
    "fp16_rounding": {"t": "stream_chunk", "id": 36, "stream": 2, "seq": 2, "data": tensor_json(
        [1.00048828125, 1.00146484375, 1.0004884004592896, 2049.0], [4], codec="fp16", rounded=True)},
    "tensor_int64": {"t": "stream_chunk", "id": 18, "stream": 4, "seq": 0,
                     "data": tensor_json([1, 2, 3], [3], "int64")},
    "probe": {"t": "probe", "id": 19, "streams": [1, 2]},
    "probe_reply": {"t": "probe_reply", "id": 20, "re": 19, "elements": 9, "bytes": 36},
    "version": {"t": "version", "id": 21, "block": 2, "round": 7, "samples": 1792, "hash": "ab" * 32,
                "synced": True},
    "update": {"t": "update", "id": 22, "block": 2, "round": 7, "base": "ab" * 32, "samples": 256, "lo": 0,
               "hi": 4096, "age": 0.0, "stream": 5},
    "update_inline": {"t": "update", "id": 38, "block": 2, "round": 7, "base": "ab" * 32, "samples": 256, "lo": 4,
                      "hi": 8, "age": 0.5, "tensor": tensor_json([0.5, -1.0, 2.0, 0.0], [4])},  # (the tensor last)
    "reduced": {"t": "reduced", "id": 37, "block": 2, "round": 7, "base": "ab" * 32, "samples": 512, "lo": 16384,
                "hi": 49152, "group": {"$bin": group_digest(["0f" * 16, "1e" * 16, "2d" * 16]).hex()},
                "members": {"$bin": "05"}, "others": ["3c" * 16], "age": 1.25, "stream": 7,
                "leaves": {"$bin": "cd" * 64}},  # 0f.., 2d.. and 3c..
    "state_get": {"t": "state_get", "id": 23, "block": 2},
    "state_reply": {"t": "state_reply", "id": 24, "re": 23, "block": 2, "round": 7, "samples": 1792,
                    "hash": "ab" * 32, "stream": 6, "config": {"model": {"d_model": 32}},
                    "members": ["0f" * 16, "1e" * 16]},
    "generate": {"t": "generate", "id": 25, "prompt": {"$bin": "54686520"}, "n_bytes": 64, "mode": "sweep", "k": 64,
                 "temperature": 0.8, "seed": 1, "route": []},
    "gen_bytes": {"t": "gen_bytes", "id": 26, "re": 25, "data": {"$bin": "746f776572"}},
    "gen_done": {"t": "gen_done", "id": 27, "re": 25, "bytes": 64, "traversals": 1,
                 "route": [["0f" * 16, "10.0.0.1:7400", 0, 3]]},
    "score": {"t": "score", "id": 28, "text": {"$bin": "736f6d652074657874"}, "chunk": 1, "seed": 0, "route": []},
    "score_reply": {"t": "score_reply", "id": 29, "re": 28, "nll": 12.5, "count": 8, "windows": 1, "route": []},
    "hop": {"t": "hop", "id": 30, "session": "5e55", "traversal": 3, "at": 1, "model": "0123456789abcdef",
            "route": [["0a" * 16, "10.0.0.1:7400", 0, 1], ["0b" * 16, "10.0.0.2:7400", 2, 3]],
            "coordinator": ["0a" * 16, "10.0.0.1:7400", 0, 0], "ctx": {"$bin": "546865"}, "start": 2, "n_noisy": 1,
            "chunk": 1, "temperature": 0.8, "seed": 1, "z": 7},
    "hop_draft": {"t": "hop", "id": 33, "session": "5e55", "traversal": 5, "at": 0, "model": "0123456789abcdef",
                  "route": [["0a" * 16, "10.0.0.1:7400", 0, 3]], "coordinator": ["0a" * 16, "10.0.0.1:7400", 0, 0],
                  "ctx": {"$bin": "546865207468"}, "start": 3, "n_noisy": 3, "chunk": 1, "temperature": 0.0,
                  "seed": 1, "draft": 2},
    "hop_done": {"t": "hop_done", "id": 31, "session": "5e55", "traversal": 3, "data": {"$bin": "21"}, "nll": 0.0,
                 "count": 0},
    "hop_error": {"t": "hop_error", "id": 32, "session": "5e55", "traversal": 3, "node": "0b" * 16,
                  "message": "cannot reach 0b0b0b0b"},
}

INVALID = {
    "zero_length": ("00000000", "bad_frame"),
    "not_a_map": ("0000000190", "bad_message"),  # a frame holding [] (an empty array)
    "unknown_type": (None, "unknown_type"),
    "wrong_field_type": (None, "bad_field"),
    "unknown_extension": (None, "unknown_ext"),
    "tensor_size_mismatch": (None, "bad_tensor"),
    "int2_signs_missing": (None, "bad_tensor"),
    "update_stream_and_tensor": (None, "bad_field"),
    "tensor_outside_a_tensor_field": (None, "bad_field"),
    "tensor_decoding_past_the_frame_limit": (None, "too_large"),
}


def invalid_frames() -> dict[str, tuple[str, str]]:
    import msgpack

    def frame(body: bytes) -> str:
        return (len(body).to_bytes(4, "big") + body).hex()

    out = dict(INVALID)
    out["unknown_type"] = (frame(msgpack.packb({"t": "launch", "id": 1})), "unknown_type")
    out["wrong_field_type"] = (frame(msgpack.packb({"t": "ping", "id": 1, "ts": "noon"})), "bad_field")
    out["unknown_extension"] = (frame(msgpack.packb({"t": "ping", "id": 1, "ts": msgpack.ExtType(7, b"x")})),
                                "unknown_ext")
    bad = msgpack.packb(["float32", [4], "raw", "none", b"\x00" * 12, b"", 0])
    out["tensor_size_mismatch"] = (frame(msgpack.packb({"t": "stream_chunk", "id": 1, "stream": 1, "seq": 0,
                                                        "data": msgpack.ExtType(1, bad)})), "bad_tensor")
    # int2: a bitmap with 3 values not 0 needs a byte of signs after it
    bad = msgpack.packb(["float32", [8], "int2", "none", b"\x16", b"\x20\x40", 256])
    out["int2_signs_missing"] = (frame(msgpack.packb({"t": "stream_chunk", "id": 1, "stream": 1, "seq": 0,
                                                      "data": msgpack.ExtType(1, bad)})), "bad_tensor")
    # an update names a stream or carries its tensor, not both
    tensor = msgpack.ExtType(1, msgpack.packb(["float32", [1], "raw", "none", b"\x00" * 4, b"", 0]))
    out["update_stream_and_tensor"] = (frame(msgpack.packb({"t": "update", "id": 1, "block": 0, "round": 0,
                                                            "base": "ab", "samples": 1, "lo": 0, "hi": 1, "age": 0.0,
                                                            "stream": 3, "tensor": tensor})), "bad_field")
    # tensors stand only in the fields the schemas give as tensor
    out["tensor_outside_a_tensor_field"] = (frame(msgpack.packb({"t": "status_reply", "id": 2, "re": 1,
                                                                 "status": {"counts": tensor}})), "bad_field")
    # 2^21 zeros in int2 + lz4: 8 MiB of float32 from about 1 KiB, past the 4 MiB a frame's tensors
    # may decode to
    zeros = torch.zeros(1 << 21)
    out["tensor_decoding_past_the_frame_limit"] = (encode({"t": "stream_chunk", "id": 1, "stream": 1, "seq": 0,
                                                           "data": EncodedTensor(encode_tensor_pieces(
                                                               zeros, "int2", "lz4"))}).hex(), "too_large")
    return out


def main() -> None:
    HERE.mkdir(exist_ok=True)
    (HERE / "invalid").mkdir(exist_ok=True)
    for name, message in VALID.items():
        frame = encode(from_json(message))
        message = with_decoded_values(message, decode_body(frame[4:]))  # lossy codecs: what arrives
        (HERE / f"{name}.json").write_text(json.dumps({"frame": frame.hex(), "message": message}, indent=1) + "\n")
    for name, (frame_hex, code) in invalid_frames().items():
        (HERE / "invalid" / f"{name}.json").write_text(json.dumps({"frame": frame_hex, "error": code}, indent=1) + "\n")
    print(f"wrote {len(VALID)} valid and {len(INVALID)} invalid vectors to {HERE}", file=sys.stderr)


if __name__ == "__main__":
    main()
