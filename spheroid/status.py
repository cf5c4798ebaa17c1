"""A node's status, typed: what a `status_reply` carries, what `spheroid status` prints, and what
launchers, clients and benches read.

`NodeStatus` is the whole of it: the node's identity, its peers (`PeerEntry`), its traffic
(`TrafficTotals`, `TrafficByType`) and the parts that what it does adds: `ServingStatus` (a serving
node) and `TrainingStatus` (a training node). A node builds one (spheroid/node/status.py) and sends
`to_dict()`; a reader makes one of a peer's map with `from_dict()`.

`to_dict()` is the JSON a node sends: its keys in the order of the fields, lists for tuples, a part
(`serving`, `training`) left out when the node has none. `from_dict()` checks a map that came from the
network: every field this module names must be there with a value of its type (an int is no bool; a
float may be an int, kept as it came), else a ValueError naming the field (`peers[1].traffic.sent.frames:
...`); keys it does not name are ignored, as a receiver ignores fields it does not know (PROTOCOL.md),
and are not in its `to_dict()`. The wire package knows none of this: to it the status is a map.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self, Union

from .averaging import AveragingConfig, Version

Scalar = str | int | float | bool | None  # a value of a checkpoint record
OMIT_NONE = {"omit_none": True}  # field metadata: a part that to_dict() leaves out when the node has none


class Record:
    """A frozen dataclass of a status, with its JSON form (`to_dict`) and a checked reader (`from_dict`)."""

    def to_dict(self) -> dict:
        return _dump(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> Self:
        """`data` (a peer's map) as this type, checked: ValueError naming the field at fault (`where`
        is the path of `data` itself, for the message)."""
        return _read(cls, data, where)


@dataclass(frozen=True)
class TrafficCounter(Record):
    """Frames and bytes one way (spheroid/node/accounting.py counts them)."""

    frames: int
    wire_bytes: int  # bytes on the socket: the frame header and the body as sent
    raw_bytes: int  # what the payload is worth uncompressed (tensor data in its own dtype)


@dataclass(frozen=True)
class TrafficTotals(Record):
    sent: TrafficCounter
    received: TrafficCounter

    @property
    def moved_bytes(self) -> int:
        """Bytes on the socket both ways: what a status line calls moved."""
        return self.sent.wire_bytes + self.received.wire_bytes


@dataclass(frozen=True)
class TrafficByType(Record):
    """Counters by message type ("hello", "status", "stream_chunk", ...), each way."""

    sent: Mapping[str, TrafficCounter]
    received: Mapping[str, TrafficCounter]


@dataclass(frozen=True)
class PeerEntry(Record):
    """A connected peer, as its hello said, with the round trip measured to it and the traffic with it."""

    node: str
    addr: str
    role: str
    blocks: tuple[int, ...]
    serves: tuple[int, ...]
    rtt_ms: float | None
    traffic: TrafficTotals


@dataclass(frozen=True)
class RoundCounters(Record):
    """A training replica's rounds and the updates and states it took or refused
    (spheroid/averaging/replica.py's `Counters`, frozen)."""

    rounds: int
    accepted: int
    late: int
    rejected: int
    adopted: int  # states fetched from peers and rebased onto
    missing: int  # cells not received by a round's deadline
    forged: int  # cells whose leaf digests, checked, were not those of their values
    capped: int  # parts averaged here that claimed more samples than `max_samples_ratio` lets count


@dataclass(frozen=True)
class RoundRecord(Record):
    """One of a trainer's last rounds: its updates, its local steps, how long the node waited for the others."""

    round: int
    updates: int
    steps: int
    waited_s: float


@dataclass(frozen=True)
class UpstreamStatus(Record):
    """What a block trainer reads of the earlier blocks: the version of each it holds (`reads`, by
    checkpoint name: the record a checkpoint keeps, {"sha256", "step"} or {"round", "samples",
    "hash", "exact"}), and the refreshes that brought them (fetches, applied as changes or
    snapshots, and the bytes they took)."""

    reads: Mapping[str, Mapping[str, Scalar]]
    fetches: int
    changes: int
    snapshots: int
    bytes: int


@dataclass(frozen=True)
class TrainingMemory(Record):
    """A trainer's training memory by kind, in MiB (spheroid/train.py's `memory_mb`); `total` is their sum."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    frozen: float
    total: float


@dataclass(frozen=True)
class TrainingStatus(Record):
    """A training node's part (`training`): its block (config.REFERENCE_PART for the reference), its
    steps and losses, the shared state it holds (`version`), its rounds, and its compute and memory."""

    block: int
    step: int
    steps: int
    loss: float  # the w(sigma)-weighted loss it minimises (NaN before its first step)
    ce: float  # the plain CE of its last batch
    round: int
    version: Version
    done: bool
    served: int  # states it sent to peers
    counters: RoundCounters
    averaging: AveragingConfig
    n_blocks: int
    params: int
    history: tuple[RoundRecord, ...]
    earlier: UpstreamStatus
    part: str  # "block" or "reference"
    flops_per_step: float
    train_flops: float
    peak_rss_mb: float
    memory_mb: TrainingMemory


@dataclass(frozen=True)
class ServingStatus(Record):
    """A serving node's part (`serving`): the blocks it serves (first, last) of which model, its
    sessions and their cache, and its counters."""

    blocks: tuple[int, ...]
    n_blocks: int
    kind: str  # "blocktrain" or "reference"
    context: int
    model: str
    sessions: int
    cache_bytes: int
    hops: int
    requests: int
    traversals: int
    failed_hops: int
    reroutes: int
    busy_waits: int
    relayed_rows: int
    batches: int


@dataclass(frozen=True)
class NodeStatus(Record):
    """A node's status (`status_reply.status`; what `spheroid status` prints)."""

    node: str
    swarm: str
    addr: str
    role: str
    blocks: tuple[int, ...]
    serves: tuple[int, ...]
    version: int  # the protocol version
    uptime_s: float
    authenticated: bool
    tls: bool
    peers: tuple[PeerEntry, ...]
    known: int
    traffic: TrafficTotals
    traffic_by_type: TrafficByType
    swarm_traffic: TrafficTotals  # between members only (client traffic left out)
    serving: ServingStatus | None = field(default=None, metadata=OMIT_NONE)
    training: TrainingStatus | None = field(default=None, metadata=OMIT_NONE)


# --- to and from JSON -------------------------------------------------------------------------------


def _dump(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _dump(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (f.metadata.get("omit_none") and getattr(value, f.name) is None)}
    if isinstance(value, (tuple, list)):
        return [_dump(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _dump(v) for k, v in value.items()}
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}


def _name(kind: Any) -> str:
    if kind in NAMES:
        return NAMES[kind]
    if kind == Scalar:
        return "a string, a number, true, false or null"
    if typing.get_origin(kind) in (Union, types.UnionType):
        return " or ".join(_name(k) for k in typing.get_args(kind))
    if typing.get_origin(kind) is tuple:
        return "a list"
    return "a map with string keys" if typing.get_origin(kind) is Mapping else "a map"


def _fail(where: str, kind: Any, value: Any) -> ValueError:
    shown = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return ValueError(f"{where or 'the status'}: expected {_name(kind)}, got {shown[:60]}")


def _read(kind: Any, value: Any, where: str) -> Any:
    """`value` as `kind` (a scalar type, a union, tuple[X, ...], Mapping[str, X] or a dataclass)."""
    origin = typing.get_origin(kind)
    if origin in (Union, types.UnionType):
        options = [k for k in typing.get_args(kind) if (k is type(None)) == (value is None)]
        if len(options) == 1:  # (X | None: X's own message, naming the field inside it at fault)
            return _read(options[0], value, where)
        for option in options:
            try:
                return _read(option, value, where)
            except ValueError:
                continue
        raise _fail(where, kind, value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _fail(where, kind, value)
        item = typing.get_args(kind)[0]
        return tuple(_read(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is Mapping:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise _fail(where, kind, value)
        item = typing.get_args(kind)[1]
        return {k: _read(item, v, f"{where}.{k[:40]}" if where else k[:40]) for k, v in value.items()}
    if dataclasses.is_dataclass(kind):
        return _read_record(kind, value, where)
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
          isinstance(value, int) and not isinstance(value, bool) if kind is int else
          value is None if kind is type(None) else isinstance(value, kind))
    if not ok:
        raise _fail(where, kind, value)
    return value


def _read_record(cls: type, value: Any, where: str) -> Any:
    if not isinstance(value, Mapping):
        raise _fail(where, cls, value)
    hints, got = _hints(cls), {}
    for f in dataclasses.fields(cls):
        path = f"{where}.{f.name}" if where else f.name
        kind = hints[f.name]
        if f.metadata.get("omit_none"):  # a part the node has (a map) or has not (no key)
            if f.name not in value:
                continue
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        elif f.name not in value:
            raise ValueError(f"{path}: missing")
        got[f.name] = _read(kind, value[f.name], path)
    try:
        return cls(**got)
    except (ValueError, TypeError) as exc:  # (a type's own checks: AveragingConfig's)
        raise ValueError(f"{where or 'the status'}: {exc}") from exc
