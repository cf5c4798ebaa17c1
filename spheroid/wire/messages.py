"""The message set of the protocol (version `VERSION`): every type, its fields and their types, in one schema.

On the wire a message is a msgpack map with "t" (the type) and "id" (the sender's message id,
unique per connection); a reply carries "re", the id it answers. Fields not listed here are ignored
(so a newer peer may add optional fields); a listed field of the wrong type is a protocol error.
New message types take a new name; a peer answers a type it does not know with an error and closes.

In code a message is a frozen dataclass generated from the schema (`Ping(ts=1.0)`, `msg.ts`);
`to_wire` and `from_wire` convert to and from the checked map. The session (session.py) sends and
receives these; only the codec and the handshake see maps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .errors import ProtocolError

VERSION = 11

# kind of each field; a trailing "?" marks it optional. The order is the canonical order of the fields
# on the wire (proto/PROTOCOL.md, section 2.1, lists the same schemas: tests/test_canonical.py checks that)
SCHEMAS: dict[str, dict[str, str]] = {
    # handshake (wire/session.py): both sides send hello first; with a swarm secret, the dialler then
    # proves it holds it, and the acceptor proves it in turn
    "hello": {"version": "uint", "swarm": "str", "node": "str", "addr": "str", "role": "str",
              "blocks": "list", "nonce": "bin", "auth": "bool", "boot": "bin", "serves": "list?",
              "model": "str?"},
    "auth": {"mac": "bin"},
    # liveness and RTT
    "ping": {"ts": "float"},
    "pong": {"ts": "float"},
    # membership gossip
    "peers": {},
    "peers_reply": {"peers": "list"},
    # introspection
    "status": {},
    "status_reply": {"status": "map"},
    # large tensors: a stream of chunk frames, reassembled by the receiver with bounded memory
    "stream_begin": {"stream": "uint", "dtype": "str", "shape": "list", "chunks": "uint", "chunk_elems": "uint"},
    "stream_chunk": {"stream": "uint", "seq": "uint", "data": "tensor"},
    # bandwidth probe: the sender streamed tensors; the receiver acknowledges what it got
    "probe": {"streams": "list"},
    "probe_reply": {"elements": "uint", "bytes": "uint"},
    # averaging same-block updates (spheroid/averaging.py), a butterfly all-reduce: "update" is the
    # part [lo, hi) of the sender's update, for the member that owns that range; "reduced" is an
    # average of parts of a range (a cell's, or in large groups a row's on its way to the cell's
    # owner); "age" is how long the sender's round had run. The tensor travels in the message
    # ("tensor", raw, when it fits in a frame) or first as a stream on the same connection, then the
    # message that names it ("stream"): one of the two
    "version": {"block": "uint", "round": "uint", "samples": "uint", "hash": "str", "synced": "bool",
                "joining": "bool?"},
    "update": {"block": "uint", "round": "uint", "base": "str", "samples": "uint", "lo": "uint", "hi": "uint",
               "age": "float", "stream": "uint?", "tensor": "tensor?"},
    "reduced": {"block": "uint", "round": "uint", "base": "str", "samples": "uint", "lo": "uint", "hi": "uint",
                "group": "bin", "members": "bin", "others": "list", "age": "float", "stream": "uint?",
                "leaves": "bin?", "tensor": "tensor?"},
    # a state transfer; with "since" (the hash of the parameters the requester holds) and "codec",
    # the responder may send the change from them to its parameters instead, in that codec (or a
    # finer one), and says so with "since" in its reply; "members" is the group of the round that
    # starts from the state; "left" the share of that round's local steps the responder has still
    # to train (absent when it is not training); "within", the seconds the requester waits for the
    # reply at least, bounds how long a responder may hold the request back
    "state_get": {"block": "uint", "since": "str?", "codec": "str?", "within": "float?"},
    "state_reply": {"block": "uint", "round": "uint", "samples": "uint", "hash": "str", "stream": "uint",
                    "config": "map", "since": "str?", "members": "list?", "left": "float?"},
    # serving (spheroid/node/serving.py): a client asks any node, which coordinates; activations go
    # hop to hop along the route, never through the client
    "generate": {"prompt": "bin", "n_bytes": "uint", "mode": "str", "k": "uint", "temperature": "float",
                 "seed": "uint", "route": "list"},
    "gen_bytes": {"data": "bin"},
    "gen_done": {"bytes": "uint", "traversals": "uint", "route": "list"},
    "score": {"text": "bin", "chunk": "uint", "seed": "uint", "route": "list", "offset": "uint?"},
    "score_reply": {"nll": "float", "count": "uint", "windows": "uint", "route": "list"},
    "hop": {"session": "str", "traversal": "uint", "route": "list", "at": "uint", "coordinator": "list", "model": "str",
            "ctx": "bin", "start": "uint", "n_noisy": "uint", "chunk": "uint", "temperature": "float",
            "seed": "uint", "z": "uint?", "targets": "bin?", "relay_from": "uint?",
            "draft": "uint?"},
    "hop_done": {"session": "str", "traversal": "uint", "data": "bin", "nll": "float", "count": "uint"},
    "hop_error": {"session": "str", "traversal": "uint", "node": "str", "message": "str", "stale": "bool?",
                  "busy": "bool?"},
    # errors and goodbyes
    "error": {"code": "str", "message": "str", "peers": "list?"},  # peers: with busy, some a dialler may try instead
    "bye": {"reason": "str"},
}
COMMON = {"t": "str", "id": "uint", "re": "uint?"}
# the fields of each type that may hold a tensor on the wire (the decoder refuses one anywhere else)
TENSOR_FIELDS = {kind: tuple(name for name, k in schema.items() if k.rstrip("?") == "tensor")
                 for kind, schema in SCHEMAS.items()}
# the reply each request waits for (`Connection.request` takes no other type under the request's id)
REPLIES = {"ping": "pong", "peers": "peers_reply", "status": "status_reply", "probe": "probe_reply",
           "state_get": "state_reply", "score": "score_reply"}
# messages that name streams which arrived before them: the field naming them, and the field the
# receiving session attaches the finished tensors under (a list of them for "probe")
STREAM_FIELDS = {"update": ("stream", "tensor"), "reduced": ("stream", "tensor"), "state_reply": ("stream", "tensor"),
                 "hop": ("z", "tensor"),
                 "probe": ("streams", "tensors")}
# the types that may carry their tensor in the message itself, in that field (their schema lists it),
# instead of naming a stream: the tensor is then the frame's last field, and read into place
INLINE = {kind: attach for kind, (_, attach) in STREAM_FIELDS.items() if attach in SCHEMAS[kind]}

# a peer entry inside peers_reply, which lists at most this many (a random sample)
MAX_PEER_ENTRIES = 64
PEER_FIELDS = {"node": "str", "addr": "str", "role": "str", "blocks": "list", "serves": "list?"}


# (each check tries the exact type first, as msgpack decodes it: every frame in and out is checked)
def _is_uint(value: Any) -> bool:
    return (type(value) is int or isinstance(value, int) and not isinstance(value, bool)) and value >= 0


def _is_number(value: Any) -> bool:
    return type(value) in (float, int) or isinstance(value, (int, float)) and not isinstance(value, bool)


def _is(kind: type) -> Callable[[Any], bool]:
    return lambda value: type(value) is kind or isinstance(value, kind)


CHECKS: dict[str, Callable[[Any], bool]] = {
    "uint": _is_uint, "float": _is_number, "str": _is(str), "bin": _is(bytes), "bool": _is(bool), "list": _is(list),
    "map": _is(dict), "tensor": _is(torch.Tensor)}


def check_kind(value: Any, kind: str) -> bool:
    return CHECKS[kind.rstrip("?")](value)


# each type's fields, checked in this order: (name, kind, optional, check); built once, since every
# frame in and out is validated
_FIELDS: dict[str, tuple[tuple[str, str, bool, Callable[[Any], bool]], ...]] = {
    kind: tuple((name, k.rstrip("?"), k.endswith("?"), CHECKS[k.rstrip("?")])
                for name, k in {**COMMON, **schema}.items())
    for kind, schema in SCHEMAS.items()}


def validate(message: Any) -> dict:
    """Check a decoded message against its schema; returns it, or raises ProtocolError."""
    if not isinstance(message, dict):
        raise ProtocolError("bad_message", f"a message must be a map, got {type(message).__name__}")
    kind = message.get("t")
    if not isinstance(kind, str):
        raise ProtocolError("bad_message", "a message needs a string field 't'")
    fields = _FIELDS.get(kind)
    if fields is None:
        raise ProtocolError("unknown_type", f"unknown message type {kind!r}")
    for name, field_kind, optional, check in fields:
        if name not in message:
            if optional:
                continue
            raise ProtocolError("bad_field", f"{kind}: missing field {name!r}")
        if not check(message[name]):
            raise ProtocolError("bad_field", f"{kind}: field {name!r} must be {field_kind}, "
                                             f"got {type(message[name]).__name__}")
    if kind in INLINE and (STREAM_FIELDS[kind][0] in message) == (INLINE[kind] in message):
        raise ProtocolError("bad_field", f"{kind}: needs one of {STREAM_FIELDS[kind][0]} (naming a stream) and "
                                         f"{INLINE[kind]} (the tensor itself)")
    return message


def validate_peer(entry: Any) -> dict:
    """Check one entry of a peers_reply list."""
    if not isinstance(entry, dict) or not all(
        check_kind(entry[k], v) if k in entry else v.endswith("?") for k, v in PEER_FIELDS.items()
    ):
        raise ProtocolError("bad_field", f"a peer entry needs {sorted(PEER_FIELDS)} of the right types")
    return entry


# --- typed messages -------------------------------------------------------------------------------

PY_TYPES = {"uint": int, "float": float, "str": str, "bin": bytes, "bool": bool, "list": list, "map": dict,
            "tensor": torch.Tensor}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Message:
    """A protocol message. `id` is assigned by the session that sends it; `re` names the request a
    reply answers. Subclasses, one per type, are generated from SCHEMAS below."""

    t: ClassVar[str] = ""
    wire_fields: ClassVar[tuple[str, ...]] = ()  # the fields that go on the wire (not attached tensors)
    wire_names: ClassVar[frozenset[str]] = frozenset()  # the same, as a set
    float_fields: ClassVar[frozenset[str]] = frozenset()  # the fields of kind float (written as float64)
    field_names: ClassVar[frozenset[str]] = frozenset()  # every field, attached tensors too
    id: int | None = None
    re: int | None = None

    def to_wire(self) -> dict:
        """The map that goes on the wire, in the canonical order (t, id, re, then the schema's fields;
        optional fields left out when None; attached tensors never), a float field's integer as a
        float (float64 on the wire, as every float)."""
        values, floats = self.__dict__, self.float_fields
        out: dict[str, Any] = {"t": self.t}
        for name in self.wire_fields:
            if (value := values[name]) is not None:
                out[name] = float(value) if type(value) is int and name in floats else value
        return out

    def replace(self, **changes: Any) -> Message:
        """A copy with some fields changed (messages are frozen). Without `dataclasses.replace`, which
        builds the copy through `__init__` field by field: every stream's message is replaced once."""
        if unknown := changes.keys() - self.field_names:
            raise TypeError(f"{type(self).__name__} has no field {sorted(unknown)[0]!r}")
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__, **changes)
        return copy


def _message_class(kind: str, schema: dict[str, str]) -> type[Message]:
    fields: list = []
    for name, field_kind in schema.items():
        typ = PY_TYPES[field_kind.rstrip("?")]
        fields.append((name, typ | None, dataclasses.field(default=None)) if field_kind.endswith("?") else (name, typ))
    if kind in STREAM_FIELDS and kind not in INLINE:  # the tensors a receiving session attaches
        fields.append((STREAM_FIELDS[kind][1], Any, dataclasses.field(default=None, metadata={"wire": False})))
    name = "".join(part.capitalize() for part in kind.split("_"))
    cls = dataclasses.make_dataclass(name, fields, bases=(Message,), frozen=True, kw_only=True,
                                     namespace={"t": kind, "__module__": __name__})
    cls.wire_fields = tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("wire", True))
    cls.wire_names = frozenset(cls.wire_fields)
    cls.float_fields = frozenset(name for name, k in schema.items() if k.rstrip("?") == "float")
    cls.field_names = frozenset(f.name for f in dataclasses.fields(cls))
    return cls


MESSAGES: dict[str, type[Message]] = {kind: _message_class(kind, schema) for kind, schema in SCHEMAS.items()}


def from_wire(message: dict, **attached: Any) -> Message:
    """A checked map (`validate`) as its typed message, with the tensors `attached` (a session
    attaches the streams the message names); fields this version does not know are dropped."""
    cls = MESSAGES[message["t"]]
    return cls(**{k: v for k, v in message.items() if k in cls.wire_names}, **attached)


# every type by name, for code that builds and matches messages
Hello, Auth, Ping, Pong = MESSAGES["hello"], MESSAGES["auth"], MESSAGES["ping"], MESSAGES["pong"]
Peers, PeersReply, Status, StatusReply = (MESSAGES[k] for k in ("peers", "peers_reply", "status", "status_reply"))
StreamBegin, StreamChunk, Probe, ProbeReply = (MESSAGES[k] for k in ("stream_begin", "stream_chunk", "probe",
                                                                     "probe_reply"))
Version, Update, Reduced, StateGet, StateReply = (MESSAGES[k] for k in ("version", "update", "reduced", "state_get",
                                                                         "state_reply"))
Generate, GenBytes, GenDone, Score, ScoreReply = (MESSAGES[k] for k in ("generate", "gen_bytes", "gen_done", "score",
                                                                        "score_reply"))
Hop, HopDone, HopError = MESSAGES["hop"], MESSAGES["hop_done"], MESSAGES["hop_error"]
Error, Bye = MESSAGES["error"], MESSAGES["bye"]

