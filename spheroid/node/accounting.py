"""Traffic accounting: frames and bytes per peer and per message type, raw and on-wire.

`summary` and `summary_by_type` are the typed totals a node's status carries (spheroid/status.py);
`totals` and `by_type` the same as plain maps, for benches and tests.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from ..status import TrafficByType, TrafficCounter, TrafficTotals

CLIENTS = "clients"  # the one accounting label of all client connections (status, assemble, ...)


@dataclass
class Counter:
    frames: int = 0
    wire_bytes: int = 0  # bytes on the socket: the frame header and the body as sent
    raw_bytes: int = 0  # what the payload is worth uncompressed (tensor data in its own dtype)

    def add(self, other: Counter) -> None:
        self.frames += other.frames
        self.wire_bytes += other.wire_bytes
        self.raw_bytes += other.raw_bytes

    def frozen(self) -> TrafficCounter:
        return TrafficCounter(self.frames, self.wire_bytes, self.raw_bytes)


Key = tuple[str, str, str]  # (direction, peer, message type)


class Traffic:
    """Counters keyed by (direction "sent"/"received", peer, message type)."""

    def __init__(self) -> None:
        self._counts: dict[Key, Counter] = defaultdict(Counter)

    def count(self, direction: str, peer: str, kind: str, wire: int, raw: int | None = None) -> None:
        counter = self._counts[(direction, peer, kind)]  # (every frame is counted: no Counter made for it)
        counter.frames += 1
        counter.wire_bytes += wire
        counter.raw_bytes += wire if raw is None else raw

    def relabel(self, old: str, new: str) -> None:
        """Move the counts of peer `old` to `new` (clients are all counted as one peer)."""
        for key in [k for k in self._counts if k[1] == old]:
            self._counts[(key[0], new, key[2])].add(self._counts.pop(key))

    def _sum(self, peer: str | None, group: Callable[[Key], str], exclude: set[str] = frozenset()
             ) -> dict[str, dict[str, Counter]]:
        out: dict[str, dict[str, Counter]] = {"sent": defaultdict(Counter), "received": defaultdict(Counter)}
        for key, c in self._counts.items():
            if (peer is None or key[1] == peer) and key[1] not in exclude:
                out[key[0]][group(key)].add(c)
        return out

    def summary(self, peer: str | None = None, exclude: set[str] = frozenset()) -> TrafficTotals:
        """Sent and received, over all peers (but `exclude`) or for one."""
        summed = self._sum(peer, lambda key: "all", exclude)
        return TrafficTotals(*(summed[d].get("all", Counter()).frozen() for d in ("sent", "received")))

    def summary_by_type(self, peer: str | None = None) -> TrafficByType:
        """Sent and received by message type, over all peers or for one."""
        summed = self._sum(peer, lambda key: key[2])
        return TrafficByType(*({k: c.frozen() for k, c in summed[d].items()} for d in ("sent", "received")))

    def totals(self, peer: str | None = None, exclude: set[str] = frozenset()) -> dict:
        """{"sent": counter, "received": counter}, over all peers (but `exclude`) or for one."""
        return self.summary(peer, exclude).to_dict()

    def by_type(self, peer: str | None = None) -> dict:
        """{direction: {message type: counter}}, over all peers or for one."""
        return self.summary_by_type(peer).to_dict()
