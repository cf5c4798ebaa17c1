"""Averaging same-block updates in deadline rounds, as a butterfly all-reduce, sans I/O.

Every replica of a block shares a versioned starting point (`SharedState`: the block's parameters
as one flat vector, the outer momentum when the outer step has one, and a `Version`). A round:

  1. each replica trains H local steps from the shared starting point; its update is its
     parameters minus that starting point;
  2. reduce-scatter: the round's group (the replica and the peers in step with it, sorted) splits
     the vector into one contiguous range per member. Each replica sends the part of its update in
     member m's range to m (a `Part`, tagged with the round, the starting point's hash and the
     samples behind it). The owner checks every part (size, finite, norm against the other parts),
     and at `wait / 2` after its own update was ready, or when every member's part is in, averages
     them weighted by samples: its range's `Reduced`;
  3. all-gather: each owner sends its `Reduced` to the group and to any other contributor, and each
     replica closes the round when every range has come in, or `wait` after its own update was
     ready, whichever is first: it applies the outer step to the assembled average and so gets the
     next shared starting point.

So a node sends 2 (n - 1) / n of the vector per round whatever the number n of replicas, where
sending the whole update to every peer costs n - 1 vectors. Replicas that received the same
`Reduced` ranges compute bit-identical states: each range was averaged once, by its owner, and
passed through the wire codec before anyone, its owner too, used it.

A range that did not arrive by the deadline (its owner died or straggled) is not averaged this
round: the shared state keeps that range as it was, and each replica carries its own part of it
over as local progress (`Closed.carry`), as it does for a range whose owner left its part out (it
came late, or was refused). No local work is lost; it goes into the next round's update. With `feedback`
(error feedback, for the lossy codecs) a replica also carries what the codec lost of its parts
(its update minus what their owners decoded), and an owner adds what the codec lost of its last
average of a range to its next average of that range: rounding errors are sent later, not dropped.
A round with a missing range counts no samples (`Version.samples` adds the least any range averaged), so
the version rule below makes such replicas adopt a complete state when one exists.

Who is waited for: the group is the replica and the peers in step with it: those whose parts went
into every range of its previous round, which everyone who closed that round with the same ranges
computes alike (or that announced its version as members). A replica is a member of its next group
only if its own parts went into every range, so it and its peers agree on the group without
depending on when announcements arrive. A replica that fetched its state (a joiner, a restart) is
not a member: it sends its parts to the members' ranges and owns none, so nobody waits for it; once
its parts are in every range it is a contributor, in step, and a member from the next round on.

When replicas diverge anyway (a late range, a restart), they announce their `Version` and one rule
settles which state the swarm keeps: a later round wins, then the state that averaged more samples,
then the smaller hash. A replica that sees a preferred version fetches that state and rebases its
local progress onto it.

Nothing here does I/O or reads a clock: times are passed in and the wire codec is a function, so
the same code runs inside a node and inside a deterministic simulation (tests/test_averaging.py).
"""

from __future__ import annotations

import hashlib
import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

CODECS = {"fp32": "raw", "fp16": "fp16", "bf16": "bf16", "int8": "int8", "int4": "int4"}  # config name -> wire codec
OUTER_STEPS = ("average", "nesterov")


@dataclass(frozen=True)
class AveragingConfig:
    """How same-block replicas average. Every benchmark states these."""

    every: int = 20  # H: local steps per round
    codec: str = "fp32"  # how updates travel: fp32, fp16, bf16, int8 or int4 (per-chunk scales)
    lz4: bool = False  # lz4 on top of the codec, kept per chunk only where it shrinks the data
    wait: float = 5.0  # seconds a replica waits for its peers' updates once its own is ready
    outer: str = "average"  # "average": plain averaging (the paper); "nesterov": DiLoCo's outer step
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    max_norm_ratio: float = 10.0  # an update whose norm is this far from its peers' is rejected
    # error feedback (lossy codecs): what the codec lost of this replica's parts, and of the ranges
    # it averaged, is added to what it sends next round, so no progress is lost to rounding
    feedback: bool = False

    @property
    def lossy(self) -> bool:
        return self.codec != "fp32"

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {sorted(CODECS)}, got {self.codec!r}")
        if self.outer not in OUTER_STEPS:
            raise ValueError(f"outer must be one of {OUTER_STEPS}, got {self.outer!r}")
        if self.every < 1 or self.wait <= 0 or self.max_norm_ratio <= 1:
            raise ValueError("need every >= 1, wait > 0 and max_norm_ratio > 1")


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


def state_hash(flat: torch.Tensor) -> str:
    """sha256 of a flat float32 state vector, as hex: what replicas compare to agree."""
    return hashlib.sha256(flat.detach().to(torch.float32).contiguous().numpy()).hexdigest()  # (no copy)


@dataclass
class SharedState:
    """The starting point of a round, identical on every replica that agrees on `version`."""

    version: Version
    params: torch.Tensor  # (P,) float32: the block's parameters, flattened in state-dict order
    momentum: torch.Tensor | None = None  # (P,) the outer momentum ("nesterov" only)

    @classmethod
    def create(cls, round_: int, samples: int, params: torch.Tensor, momentum: torch.Tensor | None) -> SharedState:
        flat = cls.pack(params, momentum)
        return cls(Version(round_, samples, state_hash(flat)), params, momentum)

    @staticmethod
    def pack(params: torch.Tensor, momentum: torch.Tensor | None) -> torch.Tensor:
        return params if momentum is None else torch.cat([params, momentum])

    def flat(self) -> torch.Tensor:
        """The vector the hash covers and a donor sends: parameters, then momentum if any."""
        return self.pack(self.params, self.momentum)

    @classmethod
    def unpack(cls, version: Version, flat: torch.Tensor, n_params: int) -> SharedState:
        """A state received from a peer; ValueError unless its size and hash are what it claims."""
        if flat.dtype != torch.float32 or flat.dim() != 1 or flat.numel() not in (n_params, 2 * n_params):
            raise ValueError(f"a block state is {n_params} or {2 * n_params} float32 values, got "
                             f"{tuple(flat.shape)} {flat.dtype}")
        if state_hash(flat) != version.hash:
            raise ValueError(f"state hash {state_hash(flat)[:12]} does not match the announced {version.hash[:12]}")
        momentum = flat[n_params:].clone() if flat.numel() == 2 * n_params else None
        return cls(version, flat[:n_params].clone(), momentum)


def partition(n_params: int, group: list[str]) -> dict[str, tuple[int, int]]:
    """Each member's range [lo, hi) of the flat vector: contiguous, in the group's sorted order,
    sizes differing by at most one. Every replica with the same group computes the same ranges."""
    members = sorted(group)
    size, extra = divmod(n_params, len(members))
    ranges, lo = {}, 0
    for i, member in enumerate(members):
        hi = lo + size + (i < extra)
        ranges[member] = (lo, hi)
        lo = hi
    return ranges


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


@dataclass
class Reduced:
    """An owner's average of the parts of its range: what every replica assembles."""

    sender: str  # the owner
    round: int
    base: str
    lo: int
    hi: int
    contributors: Contributors
    samples: int  # the samples behind the parts averaged
    delta: torch.Tensor  # (hi - lo,) float32, as decoded from the wire


@dataclass
class Closed:
    """The outcome of a round: the next shared state, whose updates went into it, and what is carried."""

    state: SharedState
    contributors: list[str]  # senders whose parts were averaged in every range
    rejected: dict[str, str]  # sender -> reason, for parts refused at reducing time
    carry: torch.Tensor | None  # (P,) this replica's own update where it was not averaged, and with
    #                              error feedback what the codec lost of it where it was (None: nothing)
    missing: int  # ranges that did not arrive by the deadline
    ready_at: float  # when this replica's own update was in


@dataclass
class Counters:
    rounds: int = 0
    accepted: int = 0
    late: int = 0
    rejected: int = 0
    adopted: int = 0  # states fetched from peers and rebased onto
    missing: int = 0  # ranges not received by a round's deadline

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class Replica:
    """One replica's side of the rounds for one block: what it holds, has received and must do.

    `wire` is the codec round trip (encode then decode) a tensor goes through when it travels:
    the replica applies it to what it keeps of its own, so that it holds what its peers decode.
    """

    me: str
    state: SharedState
    cfg: AveragingConfig
    expected: set[str] = field(default_factory=set)  # peers in step with this replica
    counters: Counters = field(default_factory=Counters)
    synced: bool = True  # a member of the next group: genesis, or its parts made every range of its last round
    wire: Callable[[torch.Tensor], torch.Tensor] = identity

    def __post_init__(self) -> None:
        self.announced: dict[str, tuple[Version, bool]] = {}  # peer -> (its version, reached by a round?)
        self.owed: torch.Tensor | None = None  # (P,) error feedback: what the codec lost of ranges averaged here
        self._start_round()

    def _start_round(self) -> None:
        self.group: list[str] = []  # fixed at submit: the members, sorted
        self.digest = b""  # the group's digest
        self.ranges: dict[str, tuple[int, int]] = {}
        self.own: torch.Tensor | None = None  # this round's update, as computed (not through the codec)
        self.own_samples = 0
        self.parts: dict[str, Part] = {}  # parts of this replica's range, its own included
        self.reduced: dict[str, Reduced] = {}  # ranges averaged, by owner
        self.rejected: dict[str, str] = {}
        self.ready_at: float | None = None  # when this replica's own update was in
        held = getattr(self, "held", {})
        # for the next round, before submit, or on another base: maybe later (one of each kind per sender)
        self.held: dict[tuple[str, str], Part | Reduced] = {}
        for message in held.values():
            self.offer(message)

    @property
    def round(self) -> int:
        return self.state.version.round

    @property
    def n_params(self) -> int:
        return self.state.params.numel()

    @property
    def range(self) -> tuple[int, int] | None:
        """The range this replica owns this round (None: not a member, or before submit)."""
        return self.ranges.get(self.me)

    # --- a round ------------------------------------------------------------------------------------

    def submit(self, delta: torch.Tensor, samples: int, now: float) -> dict[str, Part]:
        """This replica's own update: fixes the round's group and ranges, starts the deadline, and
        returns the parts to send, by owner (every owner but itself)."""
        members = set(self.expected) | ({self.me} if self.synced else set())
        self.group = sorted(members) or [self.me]
        self.digest = group_digest(self.group)
        self.ranges = partition(self.n_params, self.group)
        self.own, self.own_samples, self.ready_at = delta, samples, now
        parts = {}
        for owner, (lo, hi) in self.ranges.items():
            part = Part(self.me, self.round, self.state.version.hash, samples, lo, hi, delta[lo:hi])
            if owner == self.me:
                self.parts[self.me] = Part(**{**part.__dict__, "delta": self.wire(delta[lo:hi].contiguous())})
            else:
                parts[owner] = part
        held, self.held = self.held, {}
        for message in held.values():
            self.offer(message)
        return parts

    def offer(self, message: Part | Reduced) -> str:
        """A peer's part or reduced range: 'accepted', 'held' (a later round, before this replica's
        own update, or on another base), or why it was refused."""
        reason = self._check(message)
        if reason is None:
            if isinstance(message, Part):
                self.parts[message.sender] = message
            else:
                self.reduced[message.sender] = message
            self.counters.accepted += 1
            return "accepted"
        if reason in ("next round", "before submit", "other base"):
            self.held[type(message).__name__, message.sender] = message
            if reason == "other base":
                self.expected.discard(message.sender)  # cannot count this round unless we adopt its base
            return "held"
        if reason == "late":
            self.counters.late += 1
        else:
            self.counters.rejected += 1
        log.warning("%s from %s for round %d refused: %s", type(message).__name__.lower(), message.sender[:8],
                    message.round, reason)
        return reason

    def _check(self, m: Part | Reduced) -> str | None:
        if m.delta.dtype != torch.float32 or m.delta.dim() != 1 or m.delta.numel() != m.hi - m.lo:
            return f"wrong shape {tuple(m.delta.shape)} {m.delta.dtype} for range {m.lo}:{m.hi}"
        if not 0 <= m.lo < m.hi <= self.n_params:
            return f"range {m.lo}:{m.hi} outside the block's {self.n_params} values"
        if m.samples < 1:
            return "no samples behind it"
        norm = float(m.delta.norm())  # (one pass; finite values big enough to overflow fail too)
        if not math.isfinite(norm):
            return "NaN, Inf or overflowing values in it"
        if isinstance(m, Part):
            m.norm = norm
        if m.round < self.round:
            return "late" if m.round == self.round - 1 else "stale round"
        if m.round > self.round + 1:
            return "future round"
        if m.round == self.round + 1:
            return "next round"
        if m.base != self.state.version.hash:
            return "other base"
        if self.ready_at is None:
            return "before submit"
        if isinstance(m, Part):
            if m.sender == self.me or m.sender in self.parts:
                return "duplicate"
            if self.range != (m.lo, m.hi):
                return "not this replica's range (another partition)"
            if self.me in self.reduced:
                return "late"
            return None
        if m.sender == self.me or m.sender in self.reduced:
            return "duplicate"
        if self.ranges.get(m.sender) != (m.lo, m.hi):
            return "not the sender's range (another partition)"
        return m.contributors.problem(self.group, self.digest)

    def can_reduce(self, now: float) -> bool:
        """This replica owns a range it has not averaged yet, and every member's part is in, or half
        the deadline has passed."""
        if self.range is None or self.me in self.reduced or self.ready_at is None:
            return False
        return set(self.group) <= set(self.parts) or now >= self.ready_at + self.cfg.wait / 2

    def reduce(self) -> Reduced:
        """Average the parts of this replica's range; the result (through the codec) counts as
        received from itself. Returns it, to send to `targets()`."""
        self.rejected = self._norm_outliers(self.parts)
        for sender, reason in self.rejected.items():
            log.warning("part from %s for round %d refused: %s", sender[:8], self.round, reason)
            self.counters.rejected += 1
        used = sorted(s for s in self.parts if s not in self.rejected)  # a fixed order: the same sums anywhere
        total = sum(self.parts[s].samples for s in used)  # (>= 1: the median part is never an outlier)
        lo, hi = self.range
        average = torch.mul(self.parts[used[0]].delta, self.parts[used[0]].samples / total)
        for s in used[1:]:
            average.add_(self.parts[s].delta, alpha=self.parts[s].samples / total)
        contributors = Contributors.of(self.group, used)
        mine = Reduced(self.me, self.round, self.state.version.hash, lo, hi, contributors, total, average)
        decoded = self._with_feedback(average, lo, hi) if self.cfg.feedback and self.cfg.lossy else self.wire(average)
        self.reduced[self.me] = Reduced(**{**mine.__dict__, "delta": decoded})
        return mine

    def _with_feedback(self, average: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Error feedback on the range averaged here: add what the codec lost of it last time, keep
        what it loses this time. Returns the decoded average (what everyone uses)."""
        if self.owed is None:
            self.owed = torch.zeros_like(self.state.params)
        average.add_(self.owed[lo:hi])  # (`average` is the Reduced sent: the owed error travels in it)
        decoded = self.wire(average)
        torch.sub(average, decoded, out=self.owed[lo:hi])
        return decoded

    def targets(self) -> list[str]:
        """Who gets this replica's reduced range: the group, every contributor, and the peers that
        announced this replica's version (a joiner on it gets the round's result, and so is in step
        for the next), itself aside."""
        contributors = self.reduced[self.me].contributors.names(self.group) if self.me in self.reduced else []
        on_this_state = {p for p, (version, _) in self.announced.items() if version == self.state.version}
        return sorted((set(self.group) | set(contributors) | on_this_state) - {self.me})

    def deadline(self) -> float | None:
        """The next time something is due: averaging this replica's range, or closing the round."""
        if self.ready_at is None:
            return None
        if self.range is not None and self.me not in self.reduced:
            return self.ready_at + self.cfg.wait / 2
        return self.ready_at + self.cfg.wait

    def can_close(self, now: float, gone: set[str] = frozenset()) -> bool:
        """Own range averaged (if it owns one), and every range in (or its owner gone), or the deadline."""
        if self.ready_at is None or (self.range is not None and self.me not in self.reduced):
            return False
        waiting = set(self.ranges) - set(self.reduced) - set(gone)
        return not waiting or now >= self.ready_at + self.cfg.wait

    def close(self) -> Closed:
        """Assemble the averaged ranges, apply the outer step, move to the next round's shared state."""
        params = torch.empty_like(self.state.params)  # (every range is written below: one pass over it)
        momentum = None if self.cfg.outer == "average" else torch.empty_like(params)
        carry = None
        contributors: set[str] | None = None
        samples = []
        for owner, (lo, hi) in self.ranges.items():
            got = self.reduced.get(owner)
            self.outer_step(got.delta if got is not None else None, lo, hi, params, momentum)
            names = set(got.contributors.names(self.group)) if got is not None else set()
            if got is not None:
                samples.append(got.samples)
                contributors = names if contributors is None else contributors & names
            if got is None or self.me not in names:  # not averaged: stays this replica's progress
                carry = torch.zeros_like(params) if carry is None else carry
                carry[lo:hi] = self.own[lo:hi]
            elif self.cfg.feedback and self.cfg.lossy:  # averaged as its owner decoded it: carry the rest
                carry = torch.zeros_like(params) if carry is None else carry
                own = self.own[lo:hi]
                carry[lo:hi] = own - (self.parts[owner].delta if owner == self.me else self.wire(own.contiguous()))
        missing = set(self.ranges) - set(self.reduced)  # their owners are not in step with this replica
        self.counters.missing += len(missing)
        used = sorted((contributors or set()) - missing)
        added = 0 if missing else min(samples)
        self.state = SharedState.create(self.round + 1, self.state.version.samples + added, params, momentum)
        self.counters.rounds += 1
        self.synced = self.me in used  # a member of the next group only if its parts made every range
        self.expected = (set(used) | self._in_step()) - {self.me}
        rejected, ready_at = self.rejected, self.ready_at
        self._start_round()
        return Closed(self.state, used, rejected, carry, len(missing), ready_at)

    def outer_step(self, average: torch.Tensor | None, lo: int, hi: int, params: torch.Tensor,
                   momentum: torch.Tensor | None) -> None:
        """Range lo:hi of the new parameters (and outer momentum) from the averaged update there
        (None: it did not arrive, so no update): plain averaging, or Nesterov momentum on it. Range by
        range, as the ranges are assembled: one pass over the vector, and no vector of the average."""
        base = self.state.params[lo:hi]
        if average is None:
            average = torch.zeros_like(base)
        if self.cfg.outer == "average":
            torch.add(base, average, out=params[lo:hi])
            return
        old = self.state.momentum[lo:hi] if self.state.momentum is not None else torch.zeros_like(base)
        mu = self.cfg.outer_momentum
        torch.add(mu * old, average, out=momentum[lo:hi])
        torch.add(base, self.cfg.outer_lr * (average + mu * momentum[lo:hi]), out=params[lo:hi])

    def _norm_outliers(self, parts: dict[str, Part]) -> dict[str, str]:
        """Parts whose norm is more than max_norm_ratio away from the median norm (its own too: an owner
        must not push its own outlier into a range everyone uses). With two parts there is no
        majority, and this replica trusts its own."""
        if len(parts) < 2:
            return {}
        norms = {s: float(u.delta.norm()) if u.norm is None else u.norm for s, u in parts.items()}
        two = len(norms) == 2
        ref = norms[self.me] if two else statistics.median(norms.values())
        ratio, out = self.cfg.max_norm_ratio, {}
        for sender, norm in norms.items():
            if not (two and sender == self.me) and ref > 0 and not ref / ratio <= norm <= ref * ratio:
                out[sender] = f"norm {norm:.3g} is far outside its peers' ({ref:.3g})"
        return out

    # --- versions -----------------------------------------------------------------------------------

    def note_version(self, peer: str, version: Version, synced: bool) -> None:
        """A peer announced its version; `synced` when it got there by closing a round whose every range
        its parts went into (or holds genesis), and is still training.

        Peers in step (synced, on this replica's version) are members of its next group; a peer
        that fetched the state (a joiner, a restarted node) is not, until it has contributed.
        """
        self.announced[peer] = (version, synced)
        if synced and version == self.state.version:
            self.expected.add(peer)
        elif not synced:  # it fetched its state, or stopped training: do not wait for it
            self.expected.discard(peer)

    def _in_step(self) -> set[str]:
        return {p for p, (v, synced) in self.announced.items() if synced and v == self.state.version}

    def wants(self, version: Version, in_round: bool = False) -> bool:
        """Whether a peer's announced version should replace this replica's state.

        `in_round`: this replica is still in its round, so a version one round ahead is one it will
        most likely reach itself; it decides after closing (fetching it now would waste a transfer).
        """
        if in_round and version.round == self.round + 1:
            return False
        return version.preferred_over(self.state.version)

    def adopt(self, state: SharedState, local: torch.Tensor) -> torch.Tensor:
        """Take a fetched state; returns `local` rebased onto it.

        Progress not yet sent is kept; progress already sent as this round's update is not carried
        over (the adopted state may include it already; if it does not, it was late). This round's
        parts and ranges were relative to the old state and are dropped, except held ones on the
        new state's base, which count again. Until it has contributed to a round, this replica is
        not a member of anyone's group.
        """
        progress = local - self.state.params
        if self.own is not None:
            progress -= self.own
        rebased = state.params + progress
        self.state = state
        self.counters.adopted += 1
        self.owed = None  # (errors of ranges averaged on the old state)
        self.synced = False
        self.expected = self._in_step() - {self.me}
        self.held = {k: m for k, m in self.held.items() if m.round >= self.round}
        self._start_round()
        return rebased
