"""What replicas send each other in a round: a replica's `Part` of its update for one owner's
range, an owner's average of a cell or a row's average of one (`Reduced`), and whose parts went
into an average (`Contributors`, a bitmap over the round's group), with where each goes (`Outgoing`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


def group_digest(group: list[str]) -> bytes:
    """8 bytes that name a round's group (its sorted members): contributors travel as a bitmap over it."""
    return hashlib.sha256("\n".join(sorted(group)).encode()).digest()[:8]


@dataclass(frozen=True)
class Contributors:
    """Whose parts went into an averaged range, in about n / 8 bytes for a group of n (a list of ids
    took 32 bytes each, so at hundreds of replicas the lists outweighed the data): one bit per
    member of the sorted group named by `group`, the lowest bit of each byte first, and the ids of
    contributors outside the group (a joiner that sent its parts)."""

    group: bytes  # group_digest of the group the bits are over
    bits: bytes  # ceil(n / 8) bytes; bit i of byte i // 8 for member i
    others: tuple[str, ...] = ()

    @classmethod
    def of(cls, group: list[str], names: list[str]) -> Contributors:
        members = sorted(group)
        index = {m: i for i, m in enumerate(members)}
        bits = bytearray((len(members) + 7) // 8)
        for name in names:
            if name in index:
                bits[index[name] // 8] |= 1 << (index[name] % 8)
        return cls(group_digest(members), bytes(bits), tuple(sorted(set(names) - set(index))))

    def problem(self, group: list[str], digest: bytes) -> str | None:
        """Why these cannot be contributors of a range of the round of `group` (whose digest is
        `digest`); None: they can."""
        if self.group != digest:
            return "contributors over another group (another partition)"
        n = len(group)
        if len(self.bits) != (n + 7) // 8 or (n % 8 and self.bits[-1] >> (n % 8)):
            return f"a contributor bitmap of {len(self.bits)} bytes for a group of {n}"
        if self.others and (len(set(self.others)) != len(self.others) or set(self.others) & set(group)):
            return "repeated contributors"
        if not self.others and not any(self.bits):
            return "no contributors"
        return None

    def names(self, group: list[str]) -> list[str]:
        """The contributors' ids (for a group without `problem`), sorted."""
        members = sorted(group)
        n = len(members)
        if self.bits == b"\xff" * (n // 8) + (bytes([(1 << n % 8) - 1]) if n % 8 else b""):  # (every member)
            return sorted(members + list(self.others)) if self.others else members
        inside = [m for i, m in enumerate(members) if self.bits[i // 8] >> (i % 8) & 1]
        return sorted(inside + list(self.others))


@dataclass
class Part:
    """A replica's update restricted to one owner's range, for that owner to average."""

    sender: str
    round: int
    base: str  # hash of the shared state the update is relative to
    samples: int
    lo: int
    hi: int
    delta: torch.Tensor  # (hi - lo,) float32, as decoded from the wire
    norm: float | None = None  # delta's norm, once checked (the outlier check at reducing time reuses it)
    age: float = 0.0  # seconds since the sender's round started, when it sent this


@dataclass
class Reduced:
    """An average of parts: a cell's, as every replica assembles it (from its owner, or passed on by a
    column owner), or a row's average of one cell, on its way to the cell's owner."""

    sender: str  # who sent it
    round: int
    base: str
    lo: int
    hi: int
    contributors: Contributors
    samples: int  # the samples behind the parts averaged
    delta: torch.Tensor  # (hi - lo,) float32, as decoded from the wire
    norm: float | None = None  # delta's norm, once checked
    age: float = 0.0  # seconds since the sender's round started, when it sent this
    # a cell's average (not a row's): the digests of the state's leaves within the cell after the
    # round, the parameters' then the momentum's, as its owner computed them
    leaves: bytes | None = None


@dataclass(frozen=True)
class Outgoing:
    """A message a replica must send, and to whom."""

    message: Part | Reduced
    to: tuple[str, ...]
