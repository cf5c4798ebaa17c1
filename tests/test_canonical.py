"""proto/PROTOCOL.md as an outsider reads it: its version, its schemas, its canonical encoding, the
vectors' inputs and the codecs' arithmetic, each checked against what the reference does.

The canonical re-encoder and the quantizers here are written from the specification (sections 1.1,
2.1 and 3) with msgpack and numpy only, not with spheroid's encoder.
"""

import base64
import hashlib
import hmac
import json
import re
import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from proto.make_vectors import from_json
from spheroid.wire import SCHEMAS, VERSION, decode_body, decode_tensor, encode, encode_tensor
from spheroid.wire.messages import COMMON, MESSAGES, PEER_FIELDS, from_wire
from spheroid.wire.session import proof, transcript

PROTO = Path(__file__).resolve().parents[1] / "proto"
SPEC = (PROTO / "PROTOCOL.md").read_text()
VECTORS = sorted((PROTO / "vectors").glob("*.json"))


def spec_schemas() -> dict[str, dict[str, str]]:
    """Section 2.1's block: `type name:kind ...`, continued lines indented."""
    block = SPEC.split("### 2.1 Schemas", 1)[1].split("## 3.", 1)[0]
    schemas: dict[str, dict[str, str]] = {}
    kind = None
    for line in block.splitlines():
        if not line.startswith("    ") or not line.strip():
            continue
        words = line.split()
        if not line.startswith("     "):  # a type's first line
            kind, words = words[0], words[1:]
            schemas[kind] = {}
        for word in words:
            name, field_kind = word.split(":")
            schemas[kind][name] = field_kind
    return schemas


SCHEMA = spec_schemas()
FIELD_ORDER = {t: ["t", "id", "re", *fields] for t, fields in SCHEMA.items() if not t.startswith("<")}
FLOATS = {t: {n for n, k in fields.items() if k.rstrip("?") == "float"} for t, fields in SCHEMA.items()}


def test_the_spec_states_the_version_once_and_every_vector_carries_it():
    stated = re.findall(r"protocol version (\d+)", SPEC)
    assert stated == [str(VERSION)]  # (the top; section 9's list of changes starts with it)
    assert re.search(r"^- (\d+): ", SPEC, re.M).group(1) == str(VERSION)
    versions = [json.loads(p.read_text())["message"].get("version") for p in VECTORS
                if json.loads(p.read_text())["message"]["t"] == "hello"]
    assert versions and set(versions) == {VERSION}


def test_the_specs_schemas_are_the_codes():
    assert SCHEMA.pop("<common>") == COMMON and SCHEMA.pop("<peer>") == PEER_FIELDS
    assert list(SCHEMA.items()) == list(SCHEMAS.items())  # the same fields, kinds and order
    for kind, fields in SCHEMAS.items():
        assert kind in SPEC.split("### 2.1 Schemas")[0], f"{kind} is not in section 2's table"
        assert list(MESSAGES[kind].wire_fields) == ["id", "re", *fields]


def canonical_payload(payload: bytes) -> bytes:
    """A tensor's payload, re-encoded canonically (section 1.1: seven fields, shortest forms)."""
    fields = msgpack.unpackb(payload, raw=False)
    assert isinstance(fields, list) and len(fields) == 7
    return msgpack.packb(fields, use_bin_type=True)


def canonical_value(value):
    if isinstance(value, msgpack.ExtType):
        return msgpack.ExtType(value.code, canonical_payload(value.data))
    if isinstance(value, dict):
        return {k: canonical_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [canonical_value(v) for v in value]
    return value


def canonical_body(body: bytes) -> bytes:
    """A frame body re-encoded canonically, from section 1.1 alone: the message's fields in its schema's
    order, float fields as float64, peer entries in their order, free-form maps as received, every
    integer, string, bin, container and extension in its shortest form."""
    message = msgpack.unpackb(body, raw=False, ext_hook=msgpack.ExtType)
    kind = message["t"]
    order = FIELD_ORDER[kind]
    assert set(message) <= set(order), f"{kind} has fields outside its schema: {set(message) - set(order)}"
    out = {}
    for name in order:
        if name not in message:
            continue
        value = canonical_value(message[name])
        if name in FLOATS[kind]:
            value = float(value)
        if (kind, name) in (("peers_reply", "peers"), ("error", "peers")):
            value = [{k: e[k] for k in PEER_FIELDS if k in e} for e in value]
        out[name] = value
    return msgpack.packb(out, use_bin_type=True)


@pytest.mark.parametrize("path", VECTORS, ids=lambda p: p.stem)
def test_every_vector_is_canonical(path):
    frame = bytes.fromhex(json.loads(path.read_text())["frame"])
    body = frame[4:]
    assert len(body) == struct.unpack(">I", frame[:4])[0]
    assert canonical_body(body) == body


@pytest.mark.parametrize("path", VECTORS, ids=lambda p: p.stem)
def test_what_the_reference_sends_is_canonical_whatever_order_it_was_given(path):
    """A typed message (as the node builds them) with its fields given in reverse order, and a float
    field's integer: the frame is canonical, and decoding and encoding it again gives it byte for byte."""
    message = from_json(json.loads(path.read_text())["message"])
    if any(isinstance(v, torch.Tensor) or type(v).__name__ == "EncodedTensor" for v in message.values()):
        message = {k: torch.arange(4, dtype=torch.float32) if k in ("data", "tensor") else v
                   for k, v in message.items()}
    kind = message["t"]
    for name in FLOATS[kind]:
        if name in message:
            message[name] = int(message[name])  # (an integral float field given as an int)
    typed = MESSAGES[kind](**{k: v for k, v in reversed(message.items()) if k != "t"})
    frame = encode(typed.to_wire())
    assert canonical_body(frame[4:]) == frame[4:]
    again = encode(from_wire(decode_body(frame[4:])).to_wire())
    assert again == frame


def test_the_shortest_forms_of_section_1_1():
    """The widths of section 1.1, byte by byte, as the reference writes them."""
    def field(value) -> bytes:  # the bytes of `value` as the last field of a status_reply's status map
        body = encode({"t": "status_reply", "id": 1, "re": 1, "status": {"x": value}})[4:]
        prefix = bytes.fromhex("84a174ac7374617475735f7265706c79a2696401a2726501a6737461747573") + b"\x81\xa1x"
        assert body.startswith(prefix)
        return body[len(prefix):]

    cases = [
        (0, "00"), (127, "7f"), (128, "cc80"), (255, "ccff"), (256, "cd0100"), (65535, "cdffff"),
        (65536, "ce00010000"), (2**32 - 1, "ceffffffff"), (2**32, "cf0000000100000000"), (2**64 - 1, "cf" + "ff" * 8),
        (-1, "ff"), (-32, "e0"), (-33, "d0df"), (-128, "d080"), (-129, "d1ff7f"), (-32768, "d18000"),
        (-32769, "d2ffff7fff"), (-(2**31), "d280000000"), (-(2**31) - 1, "d3ffffffff7fffffff"),
        (1.5, "cb3ff8000000000000"), (None, "c0"), (False, "c2"), (True, "c3"),
        ("a" * 31, "bf" + "61" * 31), ("a" * 32, "d920" + "61" * 32), ("a" * 256, "da0100" + "61" * 256),
        (b"", "c400"), (b"\x01" * 256, "c50100" + "01" * 256),
        (list(range(15)), "9f" + bytes(range(15)).hex()), (list(range(16)), "dc0010" + bytes(range(16)).hex()),
    ]
    for value, expected in cases:
        assert field(value).hex() == expected, value
    assert field({str(i): 0 for i in range(16)}).hex().startswith("de0010")
    assert field({str(i): 0 for i in range(15)}).hex().startswith("8f")
    # a tensor's extension: fixext where the payload fits one exactly, else the shortest ext
    for numel, head in ((1, "c7"), (64, "c8")):
        payload = encode_tensor(torch.zeros(numel))
        assert field(torch.zeros(numel)).hex().startswith(head)
        assert canonical_payload(payload) == payload


def test_a_float_field_given_an_integer_goes_as_a_float64():
    ping = MESSAGES["ping"](id=1, ts=2)
    assert encode(ping.to_wire()).hex().endswith("a27473cb4000000000000000")


def test_the_vectors_inputs_make_their_values():
    reduced = json.loads((PROTO / "vectors" / "reduced.json").read_text())
    group, contributors = reduced["inputs"]["group"], reduced["inputs"]["contributors"]
    message = reduced["message"]
    assert message["group"]["$bin"] == hashlib.sha256("\n".join(sorted(group)).encode()).digest()[:8].hex()
    bits = sum(1 << i for i, node in enumerate(sorted(group)) if node in contributors)
    assert bytes.fromhex(message["members"]["$bin"]) == bits.to_bytes(-(-len(group) // 8), "little")
    assert message["others"] == sorted(set(contributors) - set(group))

    auth = json.loads((PROTO / "vectors" / "auth.json").read_text())
    inputs = {k: bytes.fromhex(v["$bin"]) if isinstance(v, dict) else v for k, v in auth["inputs"].items()}
    hello = bytes.fromhex(json.loads((PROTO / "vectors" / "hello.json").read_text())["frame"])[4:]
    assert inputs["dialler_hello"] == hello
    digest = hashlib.sha256(b"spheroid-handshake-v2")
    for body in (inputs["dialler_hello"], inputs["acceptor_hello"]):
        digest.update(len(body).to_bytes(4, "big") + body)
    assert digest.digest() == inputs["transcript"]
    mac = hmac.new(inputs["secret"], b"spheroid-handshake-v2|dialler|" + digest.digest(), hashlib.sha256).digest()
    assert auth["message"]["mac"]["$bin"] == mac.hex()
    reference = proof(inputs["secret"], transcript(inputs["dialler_hello"], inputs["acceptor_hello"]), "dialler")
    assert reference == mac  # (the session computes the same proof)


# --- section 3's arithmetic, in numpy ------------------------------------------------------------

F = np.float32


def int2_sum(a: np.ndarray) -> np.float32:
    """Section 3's order of int2's sum over a block (`a`: the block's |x|, padded to 256 with zeros)."""
    p = np.zeros((4, 8), F)
    for i in range(8):
        for k in range(4):
            p[k] = (p[k] + a[32 * i + 8 * k : 32 * i + 8 * k + 8]).astype(F)
    q = (((p[0] + p[1]).astype(F) + p[2]).astype(F) + p[3]).astype(F)
    s = F(0)
    for lane in range(8):
        s = F(s + q[lane])
    return s


def spec_quantize(x: np.ndarray, codec: str) -> tuple[np.ndarray, bytes]:
    """(q, scales as they travel) of float32 values, as section 3 says the encoder computes them."""
    top, block = {"int8": (127, 4096), "int4": (7, 4096), "int2": (1, 256)}[codec]
    qs, scales = [], b""
    for lo in range(0, len(x), block):
        b = x[lo : lo + block]
        big = F(np.abs(b).max())
        if codec == "int2":
            padded = np.zeros(256, F)
            padded[: len(b)] = np.abs(b)
            s = np.minimum(F(F(2.5) * F(int2_sum(padded) / F(len(b)))), big)
            s = np.array([s], F).view(np.uint32)[0] & np.uint32(0xFFFF0000)
            s = np.array([s], np.uint32).view(F)[0]
        else:
            s = F(big / F(top))
        if not s > 0:
            s = F(1)
        qs.append(np.clip(np.round((b / s).astype(F)), -top, top).astype(np.int8))
        raw = np.array([s], F).tobytes()
        scales += raw[2:] if codec == "int2" else raw
    return np.concatenate(qs), scales


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_the_quantizers_arithmetic_is_section_3s(codec):
    """Random values (ties, and an all-zero block, among them): the reference's scales are byte for byte
    those section 3 computes, and its values decode to the spec's q times those scales."""
    rng = np.random.default_rng(5)
    n = 3 * 4096 + 77 if codec != "int2" else 40 * 256 + 3
    x = (rng.standard_normal(n) * rng.random(n) ** 3).astype(F)
    x[:256] = np.round(x[:256] * 4) / 4
    x[256:512] = 0
    q, scales = spec_quantize(x, codec)
    payload = encode_tensor(torch.from_numpy(x), codec)
    fields = msgpack.unpackb(payload)
    block = {"int8": 4096, "int4": 4096, "int2": 256}[codec]
    assert fields[5] == scales and fields[6] == block
    wide = scales if codec != "int2" else b"".join(b"\0\0" + scales[i : i + 2] for i in range(0, len(scales), 2))
    per = np.repeat(np.frombuffer(wide, F), block)[:n]
    assert np.array_equal(decode_tensor(payload).numpy(), (q.astype(F) * per).astype(F))


def test_int2s_sum_is_float32s_in_section_3s_order():
    """The int2_rounding vector's block: its float32 sum in that order is 7.9999995, not the 8 the exact sum
    rounds to, and its scale 2.484375."""
    x = np.array([0.5, 1.5, -1.5, -0.2, 4.0, 0.0, 0.2, 0.1], F)
    padded = np.zeros(256, F)
    padded[:8] = np.abs(x)
    assert int2_sum(padded) == F(7.9999995) and float(np.abs(x).astype(np.float64).sum()) > 8
    _, scales = spec_quantize(x, "int2")
    assert np.frombuffer(b"\0\0" + scales, F)[0] == 2.484375

# 256 float32 values (base64) whose int2 scale depends on the order of the sum: section 3's order gives the
# reference's, a plain left-to-right sum another (found among 10^5 random blocks)
ORDER_MATTERS = (
    "FqkQuVHG2DqZbUc0cYG0OS1jCz7pZ5K9Y1cXOaLNWzs4MoE9Rx5KvUZnQb082Z47/lx6PtxH4b31FKA90GX0PqeOejsskB24/AiE"
    "vf22ITiY5Di+tu0evrMrAT4wSUq+OcEsPSHbJzpUpXq+l/0rPnMOkrs1D0c/MvSevnml+rdiGwG+u+pQPRdHjjyXmwa9DNaut6PV"
    "dz4QKJo5oItNv+iE3j4wv2Q9zcirPRv2bT5P0Xw+Y0owP7KJjbyeJWc/xf3bPSb7M78L6pg+t0MxPvdIcTonxLQ9veRBvVQDFL+X"
    "71M8XViHve6FrbWI+gw60b6NvlwjfbwqNa4/Mzzpvfk0IL0Dv609ktZhv9gDErtl6wI8gQVDOwRRnDt00bA+edfDu4l0A726xF45"
    "jem0PT23KTxPeIq+JZBDOxy3Zz/9GZC+py3EPkMCUj4khb06mHmovEu26b4fzIi45qfPPy+78r7HHOs6Sj9+vMcJ1bjesYY+y1MT"
    "Pr8IPj3xtR23Z+BzvQEy9DwfeUa/koNOvji/QDzZRXY9DvYQPvnOY70tNEQ679yMvu9H/L3MnLa722mLOz3ynL4lo1i+kVivu+aP"
    "wTeQQWA+Ue6BvmFo775K4V64Txtovei+57wplmA2y5q8OK0/VL7vbRa7SqV3vnn5jrwbLCc7lCLyvpyVTj6yx2C/XokCPJA3nz6R"
    "EiG97WZ7P4gSJrxt0Dm/dezjvl8UkbsWn6g5258uOVH1Kb425mQ6MJlRP7rQ07lz1wQ/1rk+vL2bC74xC50+LALUPT98JD5031g3"
    "zpwqP9ZZqDpht5I9f1q2uvPkPbe1BBU/Zy/kO29G2DuITem7tZnHvjUulL8rqBI/3QS4vJx2fzkHt389UoklvowcyTvleZe6U4dy"
    "vDbkMj53v8O8gOJeP75O3rsA4mo8B7Rwvj3ZhT05PSY/2NZ+PBXJhr3HZ4m6YVScPlVWi75ouJU+4wwVvK4fmr0RCJM+sreOvYNi"
    "Hb5Gs2u5/rmDv7woNj3uKAc+uK/2POKeH70tYh48+3cUPUkC5j9Jm+W56ysXPFVSHb5Gx4W8S6dPPs2XCj8wHoO9qNzyO4OAujp2"
    "Rx69Lz85O/v7+L3AJA2+baWaPcw3RjyFFUa+Ur6Mvdt6Rr22fha90Lq1sSBM1j0OpM69s9WauhekVzwO2XY9a4WMPgB3Ub3w81Q+"
    "IAqkveZp0rylqrK9P0bYPffUcb45Sq89FTU7PSPrDLmEG7o7F4XUPdq5pT01IRE6ody+PsRnkz3/bR28pGo6P7aWTrvLt1q7w6ii"
    "PnHAvrearyQ9KCGkPSrNnb4ouhU1/HwDPFimOj5jdJi9MqIQPX3/Nbx2YZq9TSBovg=="
)


def test_int2s_sum_is_in_section_3s_order_where_the_order_matters():
    x = np.frombuffer(base64.b64decode("".join(ORDER_MATTERS)), F).copy()
    _, scales = spec_quantize(x, "int2")
    assert msgpack.unpackb(encode_tensor(torch.from_numpy(x), "int2"))[5] == scales
    left_to_right = F(0)
    for value in np.abs(x):
        left_to_right = F(left_to_right + value)
    other = np.minimum(F(F(2.5) * F(left_to_right / F(256))), np.abs(x).max())
    assert (np.array([other], F).view(np.uint32)[0] >> 16) != np.frombuffer(scales, np.uint16)[0]


def test_the_canonical_re_encoder_tells_a_non_canonical_frame():
    """(The check above is no tautology: fields out of order, a wide integer, a float32 all differ.)"""
    canonical = msgpack.packb({"t": "ping", "id": 1, "ts": 2.0})
    assert canonical_body(canonical) == canonical
    for other in (msgpack.packb({"id": 1, "t": "ping", "ts": 2.0}), msgpack.packb({"t": "ping", "id": 1, "ts": 2}),
                  b"\x83\xa1t\xa4ping\xa2id\xcd\x00\x01\xa2ts\xcb@\x00\x00\x00\x00\x00\x00\x00",
                  msgpack.packb({"t": "ping", "id": 1, "ts": 2.0}, use_single_float=True)):
        assert decode_body(other)["ts"] == 2.0 and canonical_body(other) == canonical != other
