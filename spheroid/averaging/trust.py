"""Which announced states a replica may take: no one member can move replicas to a state of its own
making by announcing a later round or more samples (the version rule prefers both).

A preferred version replaces a replica's state only when it is *confirmed*, when it is a state of
the very round that made the replica's own and the replica can check it against that round, or, for
a replica in no group, when a peer of its last round can have reached it:

  - confirmed (`confirmed`): two peers announce exactly that version, or every peer of the block
    there does (one peer alone: a swarm of two, a joiner with one holder, where there is nobody to
    confirm it against; a peer there that has not announced a version yet is not one of them). A
    peer announcing a round or a sample count of its own making is its version's only holder, and
    the other peers contradict it;
  - the same round (`Made`, `inconsistency`): a replica that closed a round knows what a state of
    that round can be: the round's base, or its own values, wherever it received a cell (every
    replica that received a cell holds it bit for bit), any values of a plausible change where it
    missed one, and no more samples than its missed cells could add. So one peer that received a
    cell this replica missed is followed alone (a state fetched from it is checked before it is
    taken), and a liar can only offer values for the cells it missed;
  - ahead (`Pace`): a replica in no group (done training, or its parts missed its last round)
    follows a later round held by one peer that contributed to its last round with others, if that
    peer can have reached it: no more rounds past the replica's last close than SPEEDUP times as
    many as its own fastest round would have closed since (and MARGIN), no more samples than its
    rounds add (times `max_samples_ratio`). So the last replica still training alone is followed at
    the end; a member of a group follows no one peer ahead of it.

Only the third reads time (passed in): rounds close as soon as their cells are in, so how fast an
honest peer's rounds go is bounded only loosely, by this replica's own; the others need none.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from .rule import norm
from .state import SharedState, Version

UNCONFIRMED = "not confirmed"  # (`vet`'s answer for a state that its holders may yet confirm)
MARGIN = 2  # rounds a peer may be ahead of what `Pace` allows (it may have closed a round as this replica's began)
SPEEDUP = 10.0  # how many times faster than this replica's own fastest round a peer's may go (alone, or quicker)


def confirmed(version: Version, announced: Mapping[str, Version], live: Collection[str] | None = None) -> bool:
    """Whether `version` is confirmed by the versions peers announced: at least two of the peers
    announce it, or every one of them does (at least one). The peers: `live` if given (those of the
    block that are there, whether they announced a version yet or not), else those that announced."""
    peers = set(announced) if live is None else set(live)
    holders = sum(announced.get(peer) == version for peer in peers)
    return holders >= 2 or 0 < holders == len(peers)


@dataclass(frozen=True)
class Made:
    """What a replica knows of the round that made its state, having closed it: the state it started
    from, the state it closed with, the round's cells and those that did not arrive, and the most
    samples a state of that round can have (`samples`: its own, plus what the missed cells could
    have added: each cell at most `cap`)."""

    base: SharedState
    own: SharedState
    cells: tuple[tuple[int, int], ...]
    missed: frozenset[tuple[int, int]]
    samples: int

    @classmethod
    def of(cls, base: SharedState, own: SharedState, cells: list[tuple[int, int]],
           missed: tuple[tuple[int, int], ...], cap: int) -> Made:
        """`cap`: the most samples a cell of the round can count (no part counts more than it claims:
        the contributors times the largest claim seen, or the most any cell received counted)."""
        n = own.params.numel()
        extra = -(-sum((hi - lo) * cap for lo, hi in missed) // n)  # (rounded up: a version's samples are floored)
        return cls(base, own, tuple(cells), frozenset(missed), own.version.samples + extra)

    @property
    def round(self) -> int:
        return self.own.version.round

    def plausible(self, version: Version) -> bool:
        """Whether a state of this round could have `version`'s samples (checked again by its values)."""
        return version.round == self.round and version.samples <= self.samples

    def inconsistency(self, state: SharedState, max_ratio: float) -> str | None:
        """Why `state` cannot be a state of this round (None: it can): its samples are more than the
        round could count; or, where this replica received a cell, its values are neither this
        replica's nor the base's (the holder missed the cell); or, where it missed one, they are not
        finite or changed the base by more than `max_ratio` times the largest change of a cell it
        received (root mean square; parameters and outer momentum each)."""
        if not self.plausible(state.version):
            return f"{state.version.samples} samples are more than round {self.round - 1} could count ({self.samples})"
        if (state.momentum is None) != (self.own.momentum is None):
            return "its outer momentum is missing or unexpected"
        zeros = torch.zeros_like(self.own.params)
        sides = [(state.params, self.own.params, self.base.params)]
        if state.momentum is not None:
            base = self.base.momentum if self.base.momentum is not None else zeros
            sides.append((state.momentum, self.own.momentum, base))
        for name, (new, own, base) in zip(("parameters", "momentum"), sides, strict=False):
            scale = 0.0
            for lo, hi in self.cells:
                if (lo, hi) in self.missed:
                    continue
                if not (torch.equal(new[lo:hi], own[lo:hi]) or torch.equal(new[lo:hi], base[lo:hi])):
                    return f"its {name} {lo}:{hi}, a cell this replica received, are another round's"
                scale = max(scale, norm(own[lo:hi] - base[lo:hi]) / math.sqrt(hi - lo))
            for lo, hi in sorted(self.missed):
                change = norm(new[lo:hi] - base[lo:hi]) / math.sqrt(hi - lo)
                if not change <= max_ratio * scale:  # (NaN, Inf too)
                    return (f"its {name} {lo}:{hi}, a cell this replica missed, changed by {change:.3g} (RMS), far "
                            f"more than any cell it received ({scale:.3g})")
        return None


@dataclass
class Pace:
    """How fast a replica's rounds go, and who was in its last round with others: for a replica in
    no group, which later rounds one of those peers can have reached alone (`allows`)."""

    fastest: float | None = None  # the shortest time between its updates of two consecutive rounds, closing the first
    last: tuple[int, float] | None = None  # (round, time) of its last update
    closed: tuple[int, float] | None = None  # (its state's round, the time its update was ready) at its last close
    peers: frozenset[str] = frozenset()  # who else contributed to its last round with others
    most: int = 0  # the most samples one of its rounds added

    def submitted(self, round_: int, now: float) -> None:
        closed = self.closed is not None and self.closed[0] == round_  # (it closed the round before: no fetch between)
        if closed and self.last is not None and round_ == self.last[0] + 1 and now > self.last[1]:
            gap = now - self.last[1]
            self.fastest = gap if self.fastest is None else min(self.fastest, gap)
        self.last = (round_, now)

    def closed_round(self, round_: int, ready_at: float, others: Collection[str], added: int) -> None:
        self.closed, self.most = (round_, ready_at), max(self.most, added)
        if others:
            self.peers = frozenset(others)

    def allows(self, version: Version, own: Version, now: float | None, max_ratio: float) -> bool:
        """Whether a peer can have reached `version`, a later round than this replica's `own`, by
        `now`: in the time since this replica's last close, at SPEEDUP times its fastest pace (and
        MARGIN rounds more), each of its rounds adding at most `max_ratio` times the most one of
        this replica's did. Not without a pace (two consecutive rounds), or a time."""
        if self.fastest is None or self.closed is None or now is None or version.round <= own.round:
            return False
        reachable = self.closed[0] + MARGIN + SPEEDUP * (now - self.closed[1]) / self.fastest
        most = max_ratio * max(1, self.most) * (version.round - own.round + 1)
        return version.round <= reachable and version.samples - own.samples <= most
