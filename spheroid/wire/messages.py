"""The message set of protocol version 2: every type, its fields and their types.

A message is a msgpack map with "t" (the type) and "id" (the sender's request id, unique per
connection); a reply carries "re", the id it answers. Fields not listed here are ignored (so a
newer peer may add optional fields); a listed field of the wrong type is a protocol error. New
message types take a new name; a peer answers a type it does not know with an error and closes.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import ProtocolError

VERSION = 2

# kind of each field; a trailing "?" marks it optional
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
    # averaging same-block updates (spheroid/averaging.py): the delta or state tensor travels first
    # as a stream on the same connection, then the message that names it
    "version": {"block": "uint", "round": "uint", "samples": "uint", "hash": "str", "synced": "bool"},
    "update": {"block": "uint", "round": "uint", "base": "str", "samples": "uint", "stream": "uint"},
    "state_get": {"block": "uint"},
    "state_reply": {"block": "uint", "round": "uint", "samples": "uint", "hash": "str", "stream": "uint",
                    "config": "map"},
    # serving (spheroid/node/serving.py): a client asks any node, which coordinates; activations go
    # hop to hop along the route, never through the client
    "generate": {"prompt": "bin", "n_bytes": "uint", "mode": "str", "k": "uint", "temperature": "float",
                 "seed": "uint", "route": "list"},
    "gen_bytes": {"data": "bin"},
    "gen_done": {"bytes": "uint", "traversals": "uint", "route": "list"},
    "score": {"text": "bin", "chunk": "uint", "seed": "uint", "route": "list"},
    "score_reply": {"nll": "float", "count": "uint", "windows": "uint", "route": "list"},
    "hop": {"session": "str", "traversal": "uint", "route": "list", "at": "uint", "coordinator": "list", "model": "str",
            "ctx": "bin", "start": "uint", "n_noisy": "uint", "chunk": "uint", "temperature": "float",
            "seed": "uint", "z": "uint?", "targets": "bin?"},
    "hop_done": {"session": "str", "traversal": "uint", "data": "bin", "nll": "float", "count": "uint"},
    "hop_error": {"session": "str", "traversal": "uint", "node": "str", "message": "str"},
    # errors and goodbyes
    "error": {"code": "str", "message": "str"},
    "bye": {"reason": "str"},
}
COMMON = {"t": "str", "id": "uint", "re": "uint?"}

# a peer entry inside peers_reply, which lists at most this many (a random sample)
MAX_PEER_ENTRIES = 64
PEER_FIELDS = {"node": "str", "addr": "str", "role": "str", "blocks": "list", "serves": "list?"}


def check_kind(value: Any, kind: str) -> bool:
    kind = kind.rstrip("?")
    if kind == "uint":
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"str": str, "bin": bytes, "bool": bool, "list": list, "map": dict,
                              "tensor": torch.Tensor}[kind])


def validate(message: Any) -> dict:
    """Check a decoded message against its schema; returns it, or raises ProtocolError."""
    if not isinstance(message, dict):
        raise ProtocolError("bad_message", f"a message must be a map, got {type(message).__name__}")
    kind = message.get("t")
    if not isinstance(kind, str):
        raise ProtocolError("bad_message", "a message needs a string field 't'")
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise ProtocolError("unknown_type", f"unknown message type {kind!r}")
    for name, field_kind in {**COMMON, **schema}.items():
        if name not in message:
            if field_kind.endswith("?"):
                continue
            raise ProtocolError("bad_field", f"{kind}: missing field {name!r}")
        if not check_kind(message[name], field_kind):
            raise ProtocolError("bad_field", f"{kind}: field {name!r} must be {field_kind.rstrip('?')}, "
                                             f"got {type(message[name]).__name__}")
    return message


def validate_peer(entry: Any) -> dict:
    """Check one entry of a peers_reply list."""
    if not isinstance(entry, dict) or not all(
        check_kind(entry[k], v) if k in entry else v.endswith("?") for k, v in PEER_FIELDS.items()
    ):
        raise ProtocolError("bad_field", f"a peer entry needs {sorted(PEER_FIELDS)} of the right types")
    return entry
