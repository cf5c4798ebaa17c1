"""Averaging same-block updates in deadline rounds, sans I/O.

Every replica of a block shares a versioned starting point (`SharedState`: the block's parameters
as one flat vector, the outer momentum when the outer step has one, and a `Version`). A round:

  1. each replica trains H local steps from the shared starting point;
  2. its update is its parameters minus that starting point, tagged with the round, the starting
     point's hash and the samples behind it, and goes to every same-block peer;
  3. each replica averages (weighted by samples) the updates that reached it by its deadline,
     `wait` seconds after its own was ready, applies the outer step and so gets the next shared
     starting point. It waits for nobody but the peers in step with it (they contributed to its
     previous round, or announced its version as the result of a round of theirs), and for them
     only until the deadline: a joiner is not waited for until it has contributed to a round.

When every update reaches every replica, all replicas compute bit-identical states (the same
updates, summed in the same order, each already passed through the wire codec, the replica's own
too). When they did not (a late update, a restart, a joiner), replicas announce their `Version`
and one rule settles which state the swarm keeps: a later round wins, then the state that averaged
more samples, then the smaller hash. A replica that sees a preferred version fetches that state and
rebases its local progress onto it, so no local work is lost.

Late updates: an update for a round its receiver has already closed is dropped by that receiver
(logged and counted as late). Its sender's own state includes it; if that state averaged more
samples, the rule above makes the others adopt it, otherwise the update's work is lost to them.

Nothing here does I/O or reads a clock: times are passed in, so the same code runs inside a node
and inside a deterministic simulation (tests/test_averaging.py).
"""

from __future__ import annotations

import hashlib
import logging
import statistics
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

CODECS = {"fp32": "raw", "fp16": "fp16", "bf16": "bf16", "int8": "int8"}  # config name -> wire codec
OUTER_STEPS = ("average", "nesterov")


@dataclass(frozen=True)
class AveragingConfig:
    """How same-block replicas average. Every benchmark states these."""

    every: int = 20  # H: local steps per round
    codec: str = "fp32"  # how updates travel: fp32, fp16, bf16 or int8 (per-chunk scales)
    lz4: bool = False  # lz4 on top of the codec, kept per chunk only where it shrinks the data
    wait: float = 5.0  # seconds a replica waits for its peers' updates once its own is ready
    outer: str = "average"  # "average": plain averaging (the paper); "nesterov": DiLoCo's outer step
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    max_norm_ratio: float = 10.0  # an update whose norm is this far from its peers' is rejected

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
    return hashlib.sha256(flat.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


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


@dataclass
class Update:
    sender: str
    round: int
    base: str  # hash of the shared state the update is relative to
    samples: int
    delta: torch.Tensor  # (P,) float32, as decoded from the wire


@dataclass
class Closed:
    """The outcome of a round: the next shared state and whose updates went into it."""

    state: SharedState
    contributors: list[str]
    rejected: dict[str, str]  # sender -> reason, for updates refused at closing time


@dataclass
class Counters:
    rounds: int = 0
    accepted: int = 0
    late: int = 0
    rejected: int = 0
    adopted: int = 0  # states fetched from peers and rebased onto

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Replica:
    """One replica's side of the rounds for one block: what it holds, has received and must do."""

    me: str
    state: SharedState
    cfg: AveragingConfig
    expected: set[str] = field(default_factory=set)  # peers waited for: in step with this replica
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        self.announced: dict[str, tuple[Version, bool]] = {}  # peer -> (its version, reached by a round?)
        self.updates: dict[str, Update] = {}  # this round's updates, own included, checked for base
        self.held: dict[str, Update] = {}  # updates for the next round, or on another base: maybe later
        self.ready_at: float | None = None  # when this replica's own update was in

    @property
    def round(self) -> int:
        return self.state.version.round

    # --- updates ------------------------------------------------------------------------------------

    def submit(self, delta: torch.Tensor, samples: int, now: float) -> Update:
        """Record this replica's own update (already through the wire codec) and start the deadline."""
        own = Update(self.me, self.round, self.state.version.hash, samples, delta)
        self.updates[self.me] = own
        self.ready_at = now
        return own

    def offer(self, update: Update) -> str:
        """A peer's update: 'accepted', 'held' (a later round, or another base), or why it was rejected."""
        reason = self._check(update)
        if reason is None:
            self.updates[update.sender] = update
            self.counters.accepted += 1
            return "accepted"
        if reason in ("next round", "other base"):
            self.held[update.sender] = update
            if reason == "other base":
                self.expected.discard(update.sender)  # cannot count this round unless we adopt its base
            return "held"
        if reason == "late":
            self.counters.late += 1
        else:
            self.counters.rejected += 1
        log.warning("update from %s for round %d rejected: %s", update.sender[:8], update.round, reason)
        return reason

    def _check(self, u: Update) -> str | None:
        if u.sender == self.me or u.sender in self.updates:
            return "duplicate"
        if u.delta.dtype != torch.float32 or tuple(u.delta.shape) != tuple(self.state.params.shape):
            return f"wrong shape {tuple(u.delta.shape)} {u.delta.dtype}, expected {tuple(self.state.params.shape)}"
        if u.samples < 1:
            return "no samples behind it"
        if not torch.isfinite(u.delta).all():
            return "NaN or Inf in the update"
        if u.round < self.round:
            return "late" if u.round == self.round - 1 else "stale round"
        if u.round > self.round + 1:
            return "future round"
        if u.round == self.round + 1:
            return "next round"
        if u.base != self.state.version.hash:
            return "other base"
        return None

    # --- closing ------------------------------------------------------------------------------------

    def deadline(self) -> float | None:
        return None if self.ready_at is None else self.ready_at + self.cfg.wait

    def can_close(self, now: float, gone: set[str] = frozenset()) -> bool:
        """Own update in, and every expected peer heard from (or gone), or the deadline passed."""
        if self.ready_at is None:
            return False
        waiting = self.expected - set(self.updates) - set(gone)
        return not waiting or now >= self.ready_at + self.cfg.wait

    def close(self) -> Closed:
        """Average what arrived, apply the outer step, move to the next round's shared state."""
        candidates = self.updates
        rejected = self._norm_outliers(candidates)
        for sender, reason in rejected.items():
            log.warning("update from %s for round %d rejected: %s", sender[:8], self.round, reason)
            self.counters.rejected += 1
        used = sorted(s for s in candidates if s not in rejected)  # a fixed order: identical sums everywhere
        total = sum(candidates[s].samples for s in used)
        average = torch.zeros_like(self.state.params)
        for s in used:
            average.add_(candidates[s].delta, alpha=candidates[s].samples / total)
        params, momentum = self.outer_step(average)
        version_samples = self.state.version.samples + total
        self.state = SharedState.create(self.round + 1, version_samples, params, momentum)
        self.counters.rounds += 1
        self.expected = (set(used) | self._in_step()) - {self.me}
        self.updates, held, self.ready_at = {}, self.held, None
        self.held = {}
        for update in held.values():  # next-round updates now belong to this round
            self.offer(update)
        return Closed(self.state, used, rejected)

    def outer_step(self, average: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """New parameters from the averaged update: plain averaging, or Nesterov momentum on it."""
        base = self.state.params
        if self.cfg.outer == "average":
            return base + average, None
        momentum = self.state.momentum if self.state.momentum is not None else torch.zeros_like(base)
        momentum = self.cfg.outer_momentum * momentum + average
        return base + self.cfg.outer_lr * (average + self.cfg.outer_momentum * momentum), momentum

    def _norm_outliers(self, updates: dict[str, Update]) -> dict[str, str]:
        """Peers' updates whose norm is more than max_norm_ratio away from the median norm."""
        if len(updates) < 2:
            return {}
        norms = {s: float(u.delta.norm()) for s, u in updates.items()}
        # with two updates there is no majority: this replica trusts its own
        ref = statistics.median(norms.values()) if len(norms) > 2 else norms[self.me]
        ratio, out = self.cfg.max_norm_ratio, {}
        for sender, norm in norms.items():
            if sender != self.me and ref > 0 and not ref / ratio <= norm <= ref * ratio:
                out[sender] = f"norm {norm:.3g} is far outside its peers' ({ref:.3g})"
        return out

    # --- versions -----------------------------------------------------------------------------------

    def note_version(self, peer: str, version: Version, synced: bool) -> None:
        """A peer announced its version; `synced` when it got there by closing a round (or genesis)
        and is still training.

        Peers in step (synced, on this replica's version) are waited for; a peer that fetched the
        state (a joiner, a restarted node) is not, until it has contributed to a round.
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
        updates were relative to the old state and are dropped, except held ones on the new state's
        base, which count again.
        """
        progress = local - self.state.params
        if self.me in self.updates:
            progress -= self.updates[self.me].delta
        rebased = state.params + progress
        self.state = state
        self.counters.adopted += 1
        self.updates, self.ready_at = {}, None
        self.expected = self._in_step() - {self.me}
        held, self.held = self.held, {}
        for update in held.values():
            if update.round >= self.round:
                self.offer(update)
        return rebased
