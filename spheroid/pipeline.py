"""Routes of the inference pipeline, sans I/O: which serving nodes, in which order, cover the stack.

A serving node holds consecutive blocks (`--serve 0-1`) and announces them in membership. A route
is an ordered list of such nodes whose ranges tile blocks 0..B-1; a request travels along it,
each node running the Euler steps of its blocks and handing the noisy tensor to the next.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

UNKNOWN_RTT_MS = 1000.0  # what a hop whose RTT was never measured costs when routes are compared
HOP_COST_MS = 1.0  # ties between equally fast routes go to the one with fewer hops


class NoRoute(Exception):
    """No set of live serving nodes covers every block."""


@dataclass(frozen=True)
class Hop:
    """One node of a route and the blocks it runs."""

    node: str
    addr: str
    first: int
    last: int
    rtt_ms: float | None = None

    def to_wire(self) -> list:
        return [self.node, self.addr, self.first, self.last]

    @classmethod
    def from_wire(cls, item: object) -> Hop:
        """A route entry [node, addr, first, last]; ValueError for anything else."""
        if (not isinstance(item, list) or len(item) != 4 or not all(isinstance(v, str) for v in item[:2])
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item[2:])
                or item[2] > item[3]):
            raise ValueError("a route entry is [node, addr, first block, last block]")
        return cls(item[0], item[1], item[2], item[3])


def parse_blocks(text: str) -> tuple[int, int]:
    """'2' or '0-1' -> (first, last)."""
    if not re.fullmatch(r"[0-9]+(-[0-9]+)?", text):
        raise ValueError(f"blocks {text!r} must look like 2 or 0-1")
    first, _, last = text.partition("-")
    lo, hi = int(first), int(last or first)
    if not lo <= hi:
        raise ValueError(f"blocks {text!r} must be a range first-last with first <= last")
    return lo, hi


def serving_range(serves: list[int]) -> tuple[int, int] | None:
    """(first, last) of a node's announced consecutive blocks, or None if it serves none or they have gaps."""
    if not serves or sorted(serves) != list(range(min(serves), max(serves) + 1)):
        return None
    return min(serves), max(serves)


def build_route(servers: list[Hop], n_blocks: int, exclude: set[str] = frozenset()) -> list[Hop]:
    """The route over blocks 0..n_blocks-1 with the lowest total measured RTT (then fewest hops).

    `servers` are the candidates (each node with its whole range); `exclude` names nodes that
    failed. Dynamic programming over the first block not yet covered.
    """
    best: dict[int, tuple[float, list[Hop]]] = {0: (0.0, [])}
    for b in range(n_blocks):
        if b not in best:
            continue
        cost, route = best[b]
        for s in servers:
            if s.first != b or s.last >= n_blocks or s.node in exclude:
                continue
            c = cost + HOP_COST_MS + (s.rtt_ms if s.rtt_ms is not None else UNKNOWN_RTT_MS)
            if s.last + 1 not in best or c < best[s.last + 1][0]:
                best[s.last + 1] = (c, [*route, s])
    if n_blocks not in best:
        covered = max(best)
        raise NoRoute(f"no live serving nodes cover block {covered} onwards (of 0..{n_blocks - 1}); "
                      f"start a node with --serve for them")
    return best[n_blocks][1]


def check_route(route: list[Hop], n_blocks: int) -> None:
    """A given route must tile 0..n_blocks-1 in order; ValueError otherwise."""
    expected = 0
    for hop in route:
        if hop.first != expected:
            raise ValueError(f"route hop {hop.node[:8]} starts at block {hop.first}, expected {expected}")
        expected = hop.last + 1
    if expected != n_blocks:
        raise ValueError(f"route covers blocks 0..{expected - 1}, the model has {n_blocks}")
