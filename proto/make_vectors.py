"""Writes the golden vectors in proto/vectors/ from the reference codec (python -m proto.make_vectors).

Each vector is NAME.json: {"note": what it shows, "inputs": what its values were made from (where
they were made from something), "frame": hex of the whole frame, "message": the message as JSON},
where bytes are {"$bin": hex} and a tensor is {"$tensor": {dtype, shape, codec, compression,
values}} with `values` the decoded values, flattened. The message's fields stand in the canonical
order (PROTOCOL.md, section 1.1), and encoding the message canonically, with the tensor's codec,
gives `frame` exactly; decoding `frame` gives `message`. The rounding vectors also give `input`,
the float32 values before encoding (whose rounding the frame fixes): encode `input`, not `values`.
Every vector carries the protocol's current version where a message has one (`hello`).

Invalid frames go to vectors/invalid/: {"note", "frame", "error": the code a receiver must raise,
"frame_limit": the frame limit in force (4 MiB: after the handshake)}; each has one fault.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
from pathlib import Path

import torch

from spheroid.wire import SCHEMAS, VERSION, EncodedTensor, decode_body, encode, encode_tensor_pieces

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


def canonical(message: dict) -> dict:
    """A message's fields in the canonical order: t, id, re, then its schema's (PROTOCOL.md, 2.1)."""
    order = ["t", "id", "re", *SCHEMAS[message["t"]]]
    assert set(message) <= set(order), f"{message['t']}: fields {set(message) - set(order)} are in no schema"
    return {k: message[k] for k in order if k in message}


def group_digest(members: list[str]) -> bytes:
    """A round's group as `reduced.group` names it: the first 8 bytes of the sha256 of its sorted node ids
    joined by newlines (PROTOCOL.md, section 2, Averaging)."""
    return hashlib.sha256("\n".join(sorted(members)).encode()).digest()[:8]


def bitmap(members: list[str], contributors: list[str]) -> bytes:
    """`reduced.members`: bit i (the lowest bit of byte i // 8 first) set when the i-th of the sorted group
    contributed."""
    out = bytearray(-(-len(members) // 8))
    for i, node in enumerate(sorted(members)):
        if node in contributors:
            out[i // 8] |= 1 << (i % 8)
    return bytes(out)


HELLO = {"t": "hello", "id": 1, "version": VERSION, "swarm": "spheroid", "node": "0f" * 16, "addr": "10.0.0.1:7400",
         "role": "worker", "blocks": [2], "nonce": {"$bin": "a5" * 16}, "auth": True, "boot": {"$bin": "01" * 8}}
# the acceptor's hello of the handshake the auth vector proves (its dialler's is HELLO)
ACCEPTOR_HELLO = {"t": "hello", "id": 1, "version": VERSION, "swarm": "spheroid", "node": "1e" * 16,
                  "addr": "10.0.0.2:7400", "role": "worker", "blocks": [2], "nonce": {"$bin": "b6" * 16},
                  "auth": True, "boot": {"$bin": "02" * 8}}
SECRET = b"a swarm secret"
LABEL = b"spheroid-handshake-v2"
# the reduced vector's round: its group, sorted, and the nodes whose parts its range averages (3c.. is
# no member: it is in `others`)
GROUP = ["0f" * 16, "1e" * 16, "2d" * 16]
CONTRIBUTORS = ["0f" * 16, "2d" * 16, "3c" * 16]


def body(message: dict) -> bytes:
    return encode(from_json(canonical(message)))[4:]


def transcript(dialler: bytes, acceptor: bytes) -> bytes:
    digest = hashlib.sha256(LABEL)
    for hello in (dialler, acceptor):
        digest.update(len(hello).to_bytes(4, "big") + hello)
    return digest.digest()


def auth_vector() -> tuple[dict, dict]:
    """The dialler's proof (section 6) in the handshake of HELLO (dialler) and ACCEPTOR_HELLO, and its inputs."""
    dialler, acceptor = body(HELLO), body(ACCEPTOR_HELLO)
    th = transcript(dialler, acceptor)
    mac = hmac.new(SECRET, LABEL + b"|dialler|" + th, hashlib.sha256).digest()
    inputs = {"secret": {"$bin": SECRET.hex()}, "side": "dialler", "dialler_hello": {"$bin": dialler.hex()},
              "acceptor_hello": {"$bin": acceptor.hex()}, "transcript": {"$bin": th.hex()}}
    return {"t": "auth", "id": 2, "mac": {"$bin": mac.hex()}}, inputs


AUTH, AUTH_INPUTS = auth_vector()

VALID = {
    "hello": HELLO,
    "auth": AUTH,
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
    "int8_rounding": {"t": "stream_chunk", "id": 33, "stream": 3, "seq": 1, "data": tensor_json(
        [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.6, -127.0], [8], codec="int8", rounded=True)},
    "int8_zero_block": {"t": "stream_chunk", "id": 34, "stream": 3, "seq": 2, "data": tensor_json(
        [0.0, 0.0, 0.0], [3], codec="int8", rounded=True)},
    "int4_rounding": {"t": "stream_chunk", "id": 38, "stream": 3, "seq": 3, "data": tensor_json(
        [7.0, 0.5, 1.5, 2.5, -0.5, -1.5, 6.6, -7.0, 3.5], [9], codec="int4", rounded=True)},
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
                "hi": 49152, "group": {"$bin": group_digest(GROUP).hex()},
                "members": {"$bin": bitmap(GROUP, CONTRIBUTORS).hex()},
                "others": sorted(set(CONTRIBUTORS) - set(GROUP)), "age": 1.25, "stream": 7,
                "leaves": {"$bin": "cd" * 64}},
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

# what each vector shows, and what its values were made from
NOTES = {
    "hello": f"carries the current protocol version, {VERSION}",
    "auth": "the dialler's proof of the handshake of the hello vector (dialler) and inputs.acceptor_hello: "
            "HMAC-SHA256(secret, 'spheroid-handshake-v2|dialler|' + transcript), transcript = SHA-256("
            "'spheroid-handshake-v2' + len(D) + D + len(A) + A) over the two hellos' frame bodies (section 6)",
    "int8_rounding": "scale = 127 / 127 = 1; q = round(x / scale), half to even",
    "int8_zero_block": "an all-zero block's scale is 1",
    "int4_rounding": "scale = 7 / 7 = 1, ties to even, two values a byte (low nibble first), an odd count's last high "
                     "nibble 0",
    "int2_rounding": "S = the float32 sum of |x| in the order of section 3 = 7.9999995 (the exact sum, 8.0000000075, "
                     "would round to 8: the sum is float32's); scale = min(2.5 * (S / 8), max|x| = 4) = 2.4999998, "
                     "rounded toward zero to bfloat16: 2.484375; q = round(x / scale) in [-1, 1]: 0.5 to 0, 1.5 to "
                     "1, -1.5 to -1, 4.0 clips to 1; a bitmap of the values not 0 (0x16), then their signs (0x02: "
                     "the second of them is -1)",
    "bf16_rounding": "float32 to bfloat16 rounds to nearest, ties to even",
    "fp16_rounding": "float32 to float16 rounds to nearest, ties to even (2049 is a tie: to 2048)",
    "reduced": "group = sha256 of inputs.group joined by newlines, its first 8 bytes; members = the bitmap over the "
               "group of inputs.contributors (bit i, lowest first, for the i-th id); others = the contributors "
               "that are not members",
    "update_inline": "the tensor in the message itself, its last field",
    "hop": "fields in the canonical order (the schema's), whatever order they were given in",
}
INPUTS = {"auth": AUTH_INPUTS, "reduced": {"group": GROUP, "contributors": CONTRIBUTORS}}

INVALID = {
    "zero_length": ("00000000", "bad_frame", "a frame of length 0"),
    "not_a_map": ("0000000190", "bad_message", "a frame holding [] (an empty array)"),
}


def invalid_frames() -> dict[str, tuple[str, str, str]]:
    import msgpack

    def frame(body: bytes) -> str:
        return (len(body).to_bytes(4, "big") + body).hex()

    out = dict(INVALID)
    out["too_large"] = ("00400001" + "00" * 16, "too_large",
                        "a length of 4 MiB + 1, refused before any byte of the body is read")
    out["bytes_after_the_message"] = (frame(msgpack.packb({"t": "peers", "id": 1}) + b"\xc0"), "bad_frame",
                                      "a nil after the message's map")
    out["no_type"] = (frame(msgpack.packb({"id": 1})), "bad_message", "a map without t")
    out["unknown_type"] = (frame(msgpack.packb({"t": "launch", "id": 1})), "unknown_type", "t names no type")
    out["wrong_field_type"] = (frame(msgpack.packb({"t": "ping", "id": 1, "ts": "noon"})), "bad_field",
                               "a float field holding a str")
    out["missing_field"] = (frame(msgpack.packb({"t": "ping", "id": 1})), "bad_field", "a ping without ts")
    out["unknown_extension"] = (frame(msgpack.packb({"t": "ping", "id": 1, "ts": msgpack.ExtType(7, b"x")})),
                                "unknown_ext", "extension type 7")
    out["timestamp_extension"] = (frame(msgpack.packb({"t": "ping", "id": 1, "ts": 1.0,
                                                       "x": msgpack.Timestamp(0, 0)})), "unknown_ext",
                                  "extension type -1 (msgpack's timestamp), in a field receivers ignore")
    out["bin_map_key"] = (frame(msgpack.packb({"t": "status_reply", "id": 2, "re": 1, "status": {b"node": "x"}})),
                          "bad_msgpack", "a map key that is a bin, not a str")
    out["int_map_key"] = (frame(msgpack.packb({"t": "peers", "id": 1, "x": {1: 2}})), "bad_msgpack",
                          "a map key that is an integer")
    out["invalid_utf8"] = (frame(b"\x83" + b"".join(map(msgpack.packb, ["t", "peers", "id", 1])) + b"\xa1\xff\x01"),
                           "bad_msgpack", "a map key (a str) that is not UTF-8")
    nested = b"\x84\xa1t\xa4ping\xa2id\x01\xa2ts\x01\xa1x" + b"\x91" * 1024 + b"\x00"
    out["too_deep"] = (frame(nested), "too_deep", "1,025 nested containers, the message's map included")
    bad = msgpack.packb(["float32", [4], "raw", "none", b"\x00" * 12, b"", 0])
    out["tensor_size_mismatch"] = (frame(msgpack.packb({"t": "stream_chunk", "id": 1, "stream": 1, "seq": 0,
                                                        "data": msgpack.ExtType(1, bad)})), "bad_tensor",
                                   "4 float32 values in 12 bytes")
    bad = msgpack.packb(["float32", [8], "int2", "none", b"\x16", b"\x20\x40", 256])
    out["int2_signs_missing"] = (frame(msgpack.packb({"t": "stream_chunk", "id": 1, "stream": 1, "seq": 0,
                                                      "data": msgpack.ExtType(1, bad)})), "bad_tensor",
                                 "int2: a bitmap with 3 values not 0 needs a byte of signs after it")
    tensor = msgpack.ExtType(1, msgpack.packb(["float32", [1], "raw", "none", b"\x00" * 4, b"", 0]))
    out["update_stream_and_tensor"] = (frame(msgpack.packb({"t": "update", "id": 1, "block": 0, "round": 0,
                                                            "base": "ab", "samples": 1, "lo": 0, "hi": 1, "age": 0.0,
                                                            "stream": 3, "tensor": tensor})), "bad_field",
                                       "an update names a stream or carries its tensor, not both")
    out["tensor_outside_a_tensor_field"] = (frame(msgpack.packb({"t": "status_reply", "id": 2, "re": 1,
                                                                 "status": {"counts": tensor}})), "bad_field",
                                            "tensors stand only in the fields the schemas give as tensor")
    out["tensor_last_in_a_field_that_takes_none"] = (
        frame(msgpack.packb({"t": "stream_chunk", "id": 1, "stream": 1, "seq": 0, "data": tensor, "x": tensor})),
        "bad_field", "a stream chunk whose last field, not data, is a tensor")
    zeros = torch.zeros(1 << 21)
    out["tensor_decoding_past_the_frame_limit"] = (
        encode({"t": "stream_chunk", "id": 1, "stream": 1, "seq": 0,
                "data": EncodedTensor(encode_tensor_pieces(zeros, "int2", "lz4"))}).hex(), "too_large",
        "2^21 zeros in int2 + lz4: 8 MiB of float32 from about 1 KiB, past the 4 MiB a frame's tensors may decode to")
    return out


def main() -> None:
    HERE.mkdir(exist_ok=True)
    (HERE / "invalid").mkdir(exist_ok=True)
    for old in [*HERE.glob("*.json"), *(HERE / "invalid").glob("*.json")]:
        old.unlink()
    for name, message in VALID.items():
        message = canonical(message)
        frame = encode(from_json(message))
        message = with_decoded_values(message, decode_body(frame[4:]))  # lossy codecs: what arrives
        vector = {**({"note": NOTES[name]} if name in NOTES else {}),
                  **({"inputs": INPUTS[name]} if name in INPUTS else {}), "frame": frame.hex(), "message": message}
        (HERE / f"{name}.json").write_text(json.dumps(vector, indent=1) + "\n")
    invalid = invalid_frames()
    for name, (frame_hex, code, note) in invalid.items():
        vector = {"note": note, "frame": frame_hex, "error": code, "frame_limit": 4 << 20}
        (HERE / "invalid" / f"{name}.json").write_text(json.dumps(vector, indent=1) + "\n")
    print(f"wrote {len(VALID)} valid and {len(invalid)} invalid vectors to {HERE}", file=sys.stderr)


if __name__ == "__main__":
    main()
