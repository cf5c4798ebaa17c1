"""The starting point replicas share, and how they name it: a `Version` (round, samples, hash), and
the state's hash as a hash of hashes over leaves of `LEAF` values, so that a replica hashes only the
leaves it computed itself each round and checks a random sample of the digests its peers send
with their cells (`checked_sample`, `assembled_digests`)."""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Version:
    """Which shared state a replica holds: the round it starts, the samples behind it, its hash."""

    round: int
    samples: int
    hash: str

    def preferred_over(self, other: Version) -> bool:
        """The swarm's one rule: later round, then more samples averaged, then the smaller hash."""
        if (self.round, self.samples) != (other.round, other.samples):
            return (self.round, self.samples) > (other.round, other.samples)
        return self.hash < other.hash

    def to_wire(self) -> dict:
        return {"round": self.round, "samples": self.samples, "hash": self.hash}


LEAF = 1 << 14  # values per leaf of the state hash (64 KiB of float32)
DIGEST = 32  # bytes of a leaf's digest (sha256)
CHECKED_LEAVES = 8  # leaves of received cells a replica hashes itself each round, to check their digests


def leaf_range(lo: int, hi: int, n: int) -> range:
    """The leaves of an n-value vector that lie wholly within [lo, hi) (leaf i: values
    i * LEAF up to (i + 1) * LEAF, the last one shorter)."""
    last = hi // LEAF if hi < n else -(-n // LEAF)
    first = -(-lo // LEAF)
    return range(first, max(first, last))


def leaf_digests(values: torch.Tensor, leaves: Iterable[int]) -> list[bytes]:
    """sha256 of each of `leaves` of a vector."""
    data = values.detach().to(torch.float32).contiguous().numpy()  # (no copy)
    return [hashlib.sha256(data[i * LEAF : (i + 1) * LEAF]).digest() for i in leaves]


def tree_hash(n: int, momentum: bool, digests: list[bytes]) -> str:
    """The state hash from its leaves' digests (the parameters', then the momentum's), as hex."""
    return hashlib.sha256(struct.pack("<QB", n, momentum) + b"".join(digests)).hexdigest()


def state_hash(params: torch.Tensor, momentum: torch.Tensor | None = None) -> str:
    """The hash replicas compare to agree on a state (or a reader's copy of a block's parameters)."""
    every = leaf_range(0, params.numel(), params.numel())
    digests = leaf_digests(params, every) + (leaf_digests(momentum, every) if momentum is not None else [])
    return tree_hash(params.numel(), momentum is not None, digests)


@dataclass
class SharedState:
    """The starting point of a round, identical on every replica that agrees on `version`."""

    version: Version
    params: torch.Tensor  # (P,) float32: the block's parameters, flattened in state-dict order
    momentum: torch.Tensor | None = None  # (P,) the outer momentum ("nesterov" only)
    # with a fetched state: the group of the round that starts from it, as the holder knew it, and
    # the share of that round's local steps the holder had still to train (None: it was not training)
    members: tuple[str, ...] | None = None
    left: float | None = None

    @classmethod
    def create(cls, round_: int, samples: int, params: torch.Tensor, momentum: torch.Tensor | None) -> SharedState:
        return cls(Version(round_, samples, state_hash(params, momentum)), params, momentum)

    @staticmethod
    def pack(params: torch.Tensor, momentum: torch.Tensor | None) -> torch.Tensor:
        return params if momentum is None else torch.cat([params, momentum])

    def flat(self) -> torch.Tensor:
        """The vector a donor sends: parameters, then momentum if any."""
        return self.pack(self.params, self.momentum)

    @classmethod
    def unpack(cls, version: Version, flat: torch.Tensor, n_params: int) -> SharedState:
        """A state received from a peer; ValueError unless its size and hash are what it claims."""
        if flat.dtype != torch.float32 or flat.dim() != 1 or flat.numel() not in (n_params, 2 * n_params):
            raise ValueError(f"a block state is {n_params} or {2 * n_params} float32 values, got "
                             f"{tuple(flat.shape)} {flat.dtype}")
        params, momentum = flat[:n_params], flat[n_params:] if flat.numel() == 2 * n_params else None
        if (got := state_hash(params, momentum)) != version.hash:
            raise ValueError(f"state hash {got[:12]} does not match the announced {version.hash[:12]}")
        return cls(version, params.clone(), None if momentum is None else momentum.clone())


def checked_sample(cells: list[tuple[int, int]], n_params: int, rng: random.Random) -> dict[tuple[int, int], list[int]]:
    """The leaves a replica checks the digests of: CHECKED_LEAVES picked at random among those of
    `cells` (sorted: the cells it received from others), as cell -> positions in its leaf range."""
    sizes = [len(leaf_range(*cell, n_params)) for cell in cells]
    out: dict[tuple[int, int], list[int]] = {}
    for k in sorted(rng.sample(range(sum(sizes)), min(CHECKED_LEAVES, sum(sizes)))):
        i = 0
        while k >= sizes[i]:
            k, i = k - sizes[i], i + 1
        out.setdefault(cells[i], []).append(k)
    return out


def assembled_digests(vectors: list[torch.Tensor], sent: dict[tuple[int, int], bytes],
                      checked: dict[tuple[int, int], list[int]]) -> tuple[list[bytes], list[tuple[int, int]]]:
    """The digests of every leaf of a new state (`vectors`: its parameters, and its outer momentum if
    any): for each cell that came, those its owner sent (`sent`: cell -> its digests, the parameters'
    then the momentum's), checked at the positions `checked` names; the rest (leaves across two
    cells, missing cells) hashed here. A cell whose checked digests are not those of its values is
    hashed here whole. Returns (the digests, the cells whose digests were forged)."""
    n = vectors[0].numel()
    known: list[dict[int, bytes]] = [{} for _ in vectors]  # per vector: leaf -> its digest
    forged = []
    for cell, digests in sent.items():
        leaves = leaf_range(*cell, n)
        given = [digests[k : k + DIGEST] for k in range(0, len(digests), DIGEST)]
        sample = [leaves[k] for k in checked.get(cell, ())]
        mine = [d for v in vectors for d in leaf_digests(v, sample)]
        if mine != [given[side * len(leaves) + i - leaves.start] for side in range(len(vectors)) for i in sample]:
            given = [d for v in vectors for d in leaf_digests(v, leaves)]
            forged.append(cell)
        for side in range(len(vectors)):
            known[side].update(zip(leaves, given[side * len(leaves) : (side + 1) * len(leaves)], strict=True))
    out = []
    for vector, digests in zip(vectors, known, strict=True):
        todo = [i for i in range(-(-n // LEAF)) if i not in digests]
        digests.update(zip(todo, leaf_digests(vector, todo), strict=True))
        out += [digests[i] for i in range(len(digests))]
    return out, forged
