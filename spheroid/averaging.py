"""Averaging same-block updates in deadline rounds, as a butterfly all-reduce, sans I/O.

Every replica of a block shares a versioned starting point (`SharedState`: the block's parameters
as one flat vector, the outer momentum when the outer step has one, and a `Version`). A round:

  1. each replica trains H local steps from the shared starting point; its update is its
     parameters minus that starting point;
  2. reduce-scatter: the round's group (the replica and the peers in step with it, sorted) splits
     the vector into one contiguous range per member. Each replica sends the part of its update in
     member m's range to m (a `Part`, tagged with the round, the starting point's hash and the
     samples behind it). The owner checks every part (size, finite, norm against the other parts),
     and at `wait / 2` after the round's start, or when every member's part is in, averages them
     weighted by samples (as claimed, up to `max_samples_ratio` times the median part's or its
     own): its range's `Reduced`;
  3. all-gather: each owner sends its `Reduced` to the group and to any other contributor, and each
     replica closes the round when every range has come in, or `wait` after the round's start,
     whichever is first: it applies the outer step to the assembled average and so gets the next
     shared starting point. A round starts when the replica's update is ready, or earlier (by up to
     `wait / 2`) when a member's message of the round says its sender's round started earlier.

So a node sends 2 (n - 1) / n of the vector per round whatever the number n of replicas, where
sending the whole update to every peer costs n - 1 vectors. A group larger than
`AveragingConfig.flat` does the same in two levels (`Layout`): in rows of about sqrt(n) members
and then in columns, at `wait / 2` and `3 wait / 4`, so that a member exchanges with about
2 sqrt(n) peers, not n - 1, and still sends about two vectors. Replicas that received the same
cells compute bit-identical states: each cell was averaged once, by its owner, and passed through
the wire codec before anyone, its owner too, used it (in two levels twice, since the column owners
who pass a cell on to their rows send it as they decoded it).

A cell that did not arrive by the deadline (its owner, or the column owner passing it on, died or
straggled) is not averaged this round: the shared state keeps it as it was, and each replica
carries its own part of it over as local progress (`Closed.carry`), as it does for a cell its part
was left out of (it came late, or was refused). No local work is lost; it goes into the next
round's update. With `feedback` (error feedback, for the lossy codecs) a replica also carries what
the codec lost of its parts (its update minus what their owners decoded), and an owner adds what
the codec lost of its last average of a cell to its next average of that cell: rounding errors are
sent later, not dropped. A round counts the samples behind each cell (as its owner counted
them, `max_samples_ratio` capping what a part claims) weighted by its size, a missing cell none,
so the version rule below makes replicas that missed cells adopt a state that has them when one
exists.

Who is waited for: the group is the replica and the peers in step with it: those whose parts went
into at least half of the values of its previous round (owners of cells that did not arrive aside),
which everyone who closed that round with the same cells computes alike (or that announced its
version as members). A replica is a member of its next group only if its own parts did, so it and
its peers agree on the group without depending on when announcements arrive; half, not all, so
that a column lost with its owner does not drop the rest of that owner's row. A replica that
fetched its state (a joiner, a restart) is not a member: it sends its parts to the members' ranges
and owns none; once its parts are in, it is a contributor, in step, and a member from the next
round on. It announces its version to the row it sends its parts to, and the owners there wait for
its parts as for their row's, but no later than the row stage's time, so a slow joiner delays
nobody past it. A column owner that dies also takes with it the cells it would
have passed on to its row; the owners of those cells notice its row's average missing and send
their cells to that row themselves.

The state's hash is a hash of hashes: of each leaf of `LEAF` values of the parameters (and of the
outer momentum), so that a replica need not hash the whole state every round. A cell's owner sends,
with its average, the digests of the leaves that lie within its cell once the round's outer step is
applied; a replica hashes only the leaves of its own cells, those that straddle two cells, those
of missing cells, and `CHECKED_LEAVES` leaves of the cells it received, picked at random among them
each round, to check their owners' digests (where a cell's are wrong it hashes the whole cell and
uses its own digests, so its hash then differs from its peers' and the version rule below settles
which state the swarm keeps). So hashing costs about 1 / n of the state per round, not all of it;
an owner could still send its peers different values under the same digests, and only the
replicas whose sample falls on its cell would see it (an owner that sends one peer a whole cell of
other values is seen by that peer with a chance of about 1 - (1 - 1 / (n - 1))^CHECKED_LEAVES a
round: 71% at 8 replicas, where checking one whole cell gave 1 / (n - 1), 14%).

When replicas diverge anyway (a late range, a restart), they announce their `Version` and one rule
settles which state the swarm keeps: a later round wins, then the state that averaged more samples,
then the smaller hash. A replica that sees a preferred version fetches that state and rebases its
local progress onto it.

Nothing here does I/O or reads a clock: times are passed in and the wire codec is a function, so
the same code runs inside a node and inside a deterministic simulation (tests/test_averaging.py).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import math
import random
import statistics
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch

from .progress import QuietLog

log = logging.getLogger(__name__)

# config name -> wire codec
CODECS = {"fp32": "raw", "fp16": "fp16", "bf16": "bf16", "int8": "int8", "int4": "int4", "int2": "int2"}
OUTER_STEPS = ("average", "nesterov")


@dataclass(frozen=True)
class AveragingConfig:
    """How same-block replicas average. Every benchmark states these."""

    every: int = 20  # H: local steps per round
    codec: str = "fp32"  # how updates travel: fp32, fp16, bf16, int8, int4 or int2 (per-chunk scales)
    lz4: bool = False  # lz4 on top of the codec, kept per chunk only where it shrinks the data
    wait: float = 5.0  # seconds a replica waits for its peers' updates once its own is ready
    outer: str = "average"  # "average": plain averaging (the paper); "nesterov": DiLoCo's outer step
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    max_norm_ratio: float = 10.0  # an update whose norm is this far from its peers' is rejected
    # a part weighs in with the samples it claims, but at most this many times the median part's (or
    # the owner's own, if larger): a peer cannot outweigh its peers by claiming samples it did not
    # train (its norm is checked; its samples cannot be)
    max_samples_ratio: float = 4.0
    flat: int = 16  # groups up to this size average in one row; larger ones in rows and columns (`Layout`)
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
        if (self.every < 1 or self.wait <= 0 or self.max_norm_ratio <= 1 or not self.max_samples_ratio >= 1
                or self.flat < 1):  # (not >= 1: NaN too)
            raise ValueError("need every >= 1, wait > 0, max_norm_ratio > 1, max_samples_ratio >= 1 and flat >= 1")
        if self.codec == "int2" and not self.feedback:
            # (it zeroes values under 1.25 times its block's mean magnitude: without the error sent
            # later, small steady progress would never reach the shared state)
            raise ValueError("the int2 codec needs error feedback (--error-feedback)")


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


def norm(vector: torch.Tensor) -> float:
    """A vector's 2-norm, as the square root of its dot product with itself: one pass, about a
    quarter quicker than `vector_norm` (every part and average received is measured). NaN or Inf
    with any NaN or Inf in it, or when its squares overflow."""
    return math.sqrt(float(torch.dot(vector, vector)))


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


def split(lo: int, hi: int, k: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into k contiguous ranges whose sizes differ by at most one, the longer first."""
    size, extra = divmod(hi - lo, k)
    out = []
    for i in range(k):
        out.append((lo, lo + size + (i < extra)))
        lo = out[-1][1]
    return out


@dataclass(frozen=True)
class Layout:
    """Who averages which values in a round: the sorted group laid out in rows.

    The vector is cut into g column ranges, g the length of the shortest row, and each column
    range into one cell per row (R of them). In its row, the member at position c owns column c
    (a longer row's last member owns none): its row's parts of that range come to it
    (reduce-scatter in the row). It averages them and sends the average's cell for row r to column
    c's owner in row r, which averages the rows' averages of that cell (reduce-scatter in the
    column) and sends the result to its column and its row; each column owner passes the cells of
    its column it receives on to its row (all-gather). So a member exchanges with its row and its
    column, about 2 sqrt(n) peers, and sends at most 2 (1 + 1 / g) vectors a round (2 (1 - 1 / n)
    when the rows are equal). A group of up to `AveragingConfig.flat` members is one row: each
    member owns one range, and every other member sends it its part of it.
    """

    rows: tuple[tuple[str, ...], ...]
    columns: tuple[tuple[int, int], ...]  # column c's range of the vector
    cells: tuple[tuple[tuple[int, int], ...], ...]  # cells[c][r]: column c's cell for row r
    where: dict[str, int]  # member -> its row

    @classmethod
    def of(cls, group: list[str], n_params: int, flat: int) -> Layout:
        members = sorted(group)
        n = len(members)
        n_rows = 1 if n <= flat or n_params < 4 * n else math.isqrt(n)  # (two levels: every cell has values)
        rows = tuple(tuple(members[a:b]) for a, b in split(0, n, n_rows))
        columns = tuple(split(0, n_params, len(rows[-1])))
        cells = tuple(tuple(split(lo, hi, n_rows)) for lo, hi in columns)
        return cls(rows, columns, cells, {m: r for r, row in enumerate(rows) for m in row})

    @property
    def two_level(self) -> bool:
        return len(self.rows) > 1

    def row_of(self, name: str) -> int:
        """A member's row; anyone else's (a joiner sending its parts) by a hash every replica computes alike."""
        if name in self.where:
            return self.where[name]
        return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % len(self.rows)

    def owner(self, r: int, c: int) -> str:
        """Row r's owner of column c, who is also the owner of column c's cell for row r."""
        return self.rows[r][c]

    def owned(self, name: str) -> list[int]:
        """The columns a member owns in its row: none or one (none for anyone else)."""
        if name not in self.where:
            return []
        c = self.rows[self.where[name]].index(name)
        return [c] if c < len(self.columns) else []

    def all_cells(self) -> list[tuple[int, int, tuple[int, int]]]:
        """(column, row, cell) for every cell, in the vector's order."""
        return [(c, r, cell) for c, cells in enumerate(self.cells) for r, cell in enumerate(cells)]


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


@dataclass
class Closed:
    """The outcome of a round: the next shared state, whose updates went into it, and what is carried."""

    state: SharedState
    contributors: list[str]  # senders whose parts went into at least half of the values (none owning a missing cell)
    rejected: dict[str, str]  # sender -> reason, for parts refused at reducing time
    carry: torch.Tensor | None  # (P,) this replica's own update where it was not averaged, and with
    #                              error feedback what the codec lost of it where it was (None: nothing)
    missing: tuple[tuple[int, int], ...]  # the cells that did not arrive by the deadline
    ready_at: float  # when this replica's own update was in


@dataclass
class Counters:
    rounds: int = 0
    accepted: int = 0
    late: int = 0
    rejected: int = 0
    adopted: int = 0  # states fetched from peers and rebased onto
    missing: int = 0  # cells not received by a round's deadline
    forged: int = 0  # cells whose leaf digests, checked, were not those of their values
    capped: int = 0  # parts averaged here that claimed more samples than `max_samples_ratio` lets count

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
    rng: random.Random = field(default_factory=random.Random)  # picks the received leaves whose digests it checks

    def __post_init__(self) -> None:
        self.quiet = QuietLog(log)  # (refusals: a peer may send any number of bad messages)
        self.announced: dict[str, tuple[Version, bool]] = {}  # peer -> (its version, reached by a round?)
        self.joiners: dict[str, Version] = {}  # peers not in step that said they will send parts from a version
        self.owed: torch.Tensor | None = None  # (P,) error feedback: what the codec lost of ranges averaged here
        self.owed_rows: torch.Tensor | None = None  # (P,) ... and of the row averages sent from here (two levels)
        self._start_round()

    def _start_round(self) -> None:
        self.group: list[str] = []  # fixed at submit: the members, sorted
        self.digest = b""  # the group's digest
        self.layout: Layout | None = None
        self.row = 0  # this replica's row in the layout
        self.mine: list[int] = []  # the columns it owns in its row
        self.own: torch.Tensor | None = None  # this round's update, as computed (not through the codec)
        self.own_samples = 0
        self.parts: dict[int, dict[str, Part]] = {}  # column owned -> sender -> its part, this replica's too
        self.row_done: set[int] = set()  # columns owned whose row's parts are averaged
        self.partials: dict[tuple[int, int], dict[str, Reduced]] = {}  # cell owned -> row owner -> its row's average
        self.cell_at: dict[tuple[int, int], tuple[int, int]] = {}  # cell -> (column, row)
        self.column_at: dict[tuple[int, int], int] = {}  # column range -> column
        self.reduced: dict[tuple[int, int], Reduced] = {}  # cell -> its average, as this replica uses it
        # the next state's parameters (and outer momentum), each cell's values written as its
        # average comes in (while it is in the cache), the others' at the close (from submit on)
        self.next_params: torch.Tensor | None = None
        self.next_momentum: torch.Tensor | None = None
        self.lent: set[tuple[int, int]] = set()  # cells whose average is read straight into next_params (`place`)
        self.outbox: list[Outgoing] = []  # cells received to pass on to this replica's row
        self.sent_cells: dict[tuple[int, int], Reduced] = {}  # cells it sent or passed on, as sent
        self.senders: set[str] = set()  # who sent it parts this round, in time or not
        self.rejected: dict[str, str] = {}
        self.ready_at: float | None = None  # when this replica's own update was in
        self.start: float | None = None  # the round's start: then, or its first message if earlier
        self.given_up: set[tuple[int, int]] = set()  # cells owned that came due too late to send
        held = getattr(self, "held", {})
        # for the next round, before submit, or on another base: maybe later (by kind, sender and
        # range, with when each came)
        self.held: dict[tuple, tuple[Part | Reduced, float | None]] = {}
        for message, at in held.values():
            self.offer(message, at)

    @property
    def round(self) -> int:
        return self.state.version.round

    @property
    def n_params(self) -> int:
        return self.state.params.numel()

    @property
    def _sides(self) -> int:
        """Vectors the state hash covers: the parameters, and the outer momentum if there is one."""
        return 1 if self.cfg.outer == "average" else 2

    @property
    def owns(self) -> bool:
        """Whether this replica averages a range this round (a member; not before submit)."""
        return bool(self.mine)

    # --- a round ------------------------------------------------------------------------------------

    def submit(self, delta: torch.Tensor, samples: int, now: float) -> list[Outgoing]:
        """This replica's own update: fixes the round's group and layout, starts the deadline, and
        returns the parts to send, each to the owner of its column in this replica's row."""
        members = set(self.expected) | ({self.me} if self.synced else set())
        self.group = sorted(members) or [self.me]
        self.digest = group_digest(self.group)
        self.layout = Layout.of(self.group, self.n_params, self.cfg.flat)
        self.row, self.mine = self.layout.row_of(self.me), self.layout.owned(self.me)
        self.cell_at = {cell: (c, r) for c, r, cell in self.layout.all_cells()}
        self.column_at = {column: c for c, column in enumerate(self.layout.columns)}
        self.parts = {c: {} for c in self.mine}
        self.partials = {self.layout.cells[c][self.row]: {} for c in self.mine} if self.layout.two_level else {}
        self.own, self.own_samples, self.ready_at, self.start = delta, samples, now, now
        self.next_params = torch.empty_like(self.state.params)
        self.next_momentum = None if self.cfg.outer == "average" else torch.empty_like(self.state.params)
        out = []
        for c, (lo, hi) in enumerate(self.layout.columns):
            part = Part(self.me, self.round, self.state.version.hash, samples, lo, hi, delta[lo:hi],
                        age=now - self.start)
            if c in self.parts:
                self.parts[c][self.me] = replace(part, delta=self.wire(delta[lo:hi].contiguous()))
            else:
                out.append(Outgoing(part, (self.layout.owner(self.row, c),)))
        order = {name: k for k, name in enumerate(self._after_me(o.to[0] for o in out))}
        out.sort(key=lambda o: order[o.to[0]])
        held, self.held = self.held, {}
        for message, at in held.values():
            self.offer(message, at)
        return out

    def offer(self, message: Part | Reduced, now: float | None = None) -> str:
        """A peer's part, row average or averaged cell, arrived at `now`: 'accepted', 'held' (a later
        round, before this replica's own update, or on another base), or why it was refused."""
        reason = self._check(message)
        if now is not None and reason is None:
            self._heard(message, now)
        if isinstance(message, Part) and message.round == self.round and reason in (None, "late"):
            self._joined(message.sender)
        if reason is None:
            if isinstance(message, Part):
                self.parts[self.column_at[message.lo, message.hi]][message.sender] = message
            else:
                self._take(message)
            self.counters.accepted += 1
            return "accepted"
        if reason in ("next round", "before submit", "other base"):
            return self._hold(message, now)
        if reason == "late":
            self.counters.late += 1
        else:
            self.counters.rejected += 1
        self.quiet.log(logging.WARNING, "refused", "%s from %s for round %d refused: %s",
                       type(message).__name__.lower(), message.sender[:8], message.round, reason)
        return reason

    def place(self, sender: str, round_: int, base: str, lo: int, hi: int) -> torch.Tensor | None:
        """Where the average of cell lo:hi, coming from `sender`, may be read as it arrives: its place in
        the next state's parameters, if it is a cell this replica waits for from its owner this round
        (in one level, where no cell is passed on); None otherwise (it gets memory of its own).

        The outer step then adds the base to it in place (the values are read once, and no vector of
        the average is written), and the message's `delta` is the new values once it is taken. A cell
        read there but refused leaves garbage that the close overwrites with the base, as for any cell
        missing; one still arriving at the close gets the old memory to itself (`close`). The caller
        (the session) gives each place to one frame: a cell is lent once a round."""
        cell = lo, hi
        at = self.cell_at.get(cell)
        if (at is None or self.layout.two_level or self.ready_at is None or round_ != self.round
                or base != self.state.version.hash or cell in self.reduced or cell in self.lent
                or sender == self.me or sender != self.layout.owner(at[1], at[0])):
            return None
        self.lent.add(cell)
        return self.next_params[lo:hi]

    def _hold(self, m: Part | Reduced, now: float | None) -> str:
        """Keep a message for later (with when it came), a few per sender: a round's messages from one
        peer are its parts, a row's average, and the cells of one column."""
        key = type(m).__name__, m.sender, m.lo, m.hi
        per_sender = math.isqrt(len(self.expected) + 1) + 3
        if key not in self.held and (sum(k[1] == m.sender for k in self.held) >= per_sender
                                     or len(self.held) >= per_sender * (len(self.expected) + 16)):
            self.quiet.log(logging.WARNING, "dropped", "%s from %s for round %d dropped: too many held already",
                           type(m).__name__.lower(), m.sender[:8], m.round)
            return "too many held"
        self.held[key] = (m, now)
        return "held"

    def _heard(self, m: Part | Reduced, now: float) -> None:
        """A member's message of this round arrived: the round started no later than its sender's
        start. The earliest start spreads from peer to peer, so that replicas close about together
        and an average sent by its stage's time reaches every replica before it closes. But never more
        than half of `wait` before this replica's own update was ready: a replica far ahead of the
        others (or a peer claiming an old start) cannot make everyone else's stages come at once."""
        if m.sender not in self.layout.where:
            return
        age = min(max(m.age, 0.0), self.cfg.wait) if math.isfinite(m.age) else 0.0
        self.start = max(min(self.start, now - age), self.ready_at - self.cfg.wait / 2)

    def _joined(self, sender: str) -> None:
        """A part came from `sender`, which is on this replica's state, in time or late: it gets the
        cells this replica sends its row (a joiner not yet in the group, a member that came late),
        those already sent included."""
        if sender not in self.senders:
            self.senders.add(sender)
            self.outbox += [Outgoing(m, (sender,)) for m in self.sent_cells.values()]

    def _take(self, m: Reduced) -> None:
        cell = m.lo, m.hi
        c, r = self.cell_at[cell]
        owner = self.layout.owner(r, c)
        if owner == self.me:  # a row's average of this replica's cell
            self.partials[cell][m.sender] = m
            return
        direct = m.sender == owner
        if direct and c in self.mine:  # a column peer's cell: pass it on to this replica's row, as received
            self.outbox.append(Outgoing(m, tuple(self._row_targets())))
            self.sent_cells[cell] = m
        if direct and self.layout.two_level and self.cfg.lossy:  # decoded once more, as relayed ones are
            m = replace(m, delta=self.wire(m.delta))
        self.reduced[cell] = m  # (its delta is not used again: read in place, it becomes the new values)
        self._step(m.delta, *cell)

    def _check(self, m: Part | Reduced) -> str | None:
        if m.delta.dtype != torch.float32 or m.delta.dim() != 1 or m.delta.numel() != m.hi - m.lo:
            return f"wrong shape {tuple(m.delta.shape)} {m.delta.dtype} for range {m.lo}:{m.hi}"
        if not 0 <= m.lo < m.hi <= self.n_params:
            return f"range {m.lo}:{m.hi} outside the block's {self.n_params} values"
        if m.samples < 1:
            return "no samples behind it"
        m.norm = norm(m.delta)
        if not math.isfinite(m.norm):
            return "NaN, Inf or overflowing values in it"
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
        layout = self.layout
        if isinstance(m, Part):
            c = self.column_at.get((m.lo, m.hi))
            if c is None or layout.owner(layout.row_of(m.sender), c) != self.me:
                return "not this replica's range (another partition)"
            if m.sender == self.me or m.sender in self.parts[c]:
                return "duplicate"
            return "late" if c in self.row_done else None
        cell = m.lo, m.hi
        if cell not in self.cell_at:
            return "not the sender's range (another partition)"
        c, r = self.cell_at[cell]
        if layout.owner(r, c) == self.me:  # must be another row's average of this replica's cell
            row = layout.where.get(m.sender)
            if not layout.two_level or row is None or row == self.row or layout.owner(row, c) != m.sender:
                return "not the sender's range (another partition)"
            if m.sender in self.partials[cell]:
                return "duplicate"
            if cell in self.reduced:
                return "late"
        elif cell in self.reduced:
            return "duplicate"
        elif m.sender not in (layout.owner(r, c), layout.owner(self.row, c)):  # its owner, or it passed on
            return "not the sender's range (another partition)"
        elif m.leaves is None or len(m.leaves) != DIGEST * self._sides * len(leaf_range(*cell, self.n_params)):
            return "leaf digests missing, or not one for each leaf within the cell"
        return m.contributors.problem(self.group, self.digest)

    def _due_at(self, stage: str) -> float:
        """When a stage comes, from the round's start: averaging a row's parts at half of `wait` (the
        most of it, as updates come ready over a spread of times), in two levels averaging the rows'
        averages of a cell at three quarters; the last moment to average anything (a quarter, or an
        eighth, before the close: what is sent then must reach every replica before it closes); the
        close."""
        share = {"row": 0.5, "cell": 0.75, "last": 0.875 if self.layout.two_level else 0.75, "close": 1.0}
        return self.start + self.cfg.wait * share[stage]

    def due(self, now: float) -> list[Outgoing]:
        """What this replica must send now: the averages of its columns' parts in its row (once every
        row member's part is in, or at the first stage's time), of its cells' row averages (every
        row's in, or the second stage's), and the cells it passes on.

        After the last moment it averages nothing more: a cell sent then would reach some peers
        after they closed and not others, and the states would differ. A replica that finds itself
        there (its peers' messages moved its start earlier, or it could not run in time) leaves its
        cells missing, as they are for the peers that closed without them.
        """
        out, self.outbox = self.outbox, []
        if self.ready_at is None:
            return out
        if now >= self._due_at("last"):
            self.row_done.update(self.mine)
            self.given_up.update(cell for cell in self._own_cells() if cell not in self.reduced)
        else:
            out += self._averages(now)
        return [Outgoing(replace(o.message, age=now - self.start), o.to) for o in out]

    def _averages(self, now: float) -> list[Outgoing]:
        """The averages whose inputs are all in, or whose stage's time has come."""
        out = []
        row = set(self.layout.rows[self.row]) | self._joining()
        for c in self.mine:
            if c not in self.row_done and (row <= set(self.parts[c]) or now >= self._due_at("row")):
                out += self._average_row(c)
        for c in self.mine if self.layout.two_level else []:
            cell = self.layout.cells[c][self.row]
            if (c in self.row_done and cell not in self.reduced
                    and (len(self.partials[cell]) == len(self.layout.rows) or now >= self._due_at("cell"))):
                out.append(self._average_cell(c, cell))
        return out

    def _average(self, kept: dict[str, Part | Reduced]) -> tuple[list[str], int, torch.Tensor]:
        """The samples-weighted average of what passes the outlier check, in a fixed order (the same
        sums anywhere): (senders used, samples, average)."""
        reference = self._reference_samples(kept)
        rejected = self._norm_outliers(kept, reference)
        for sender, reason in rejected.items():
            self.quiet.log(logging.WARNING, "outlier", "%s from %s for round %d refused: %s",
                           type(kept[sender]).__name__.lower(), sender[:8], self.round, reason)
            self.counters.rejected += 1
        self.rejected.update(rejected)
        used = sorted(s for s in kept if s not in rejected)
        counted = self._counted_samples({s: kept[s] for s in used}, reference)
        total = sum(counted.values())  # (>= 1: the median is never an outlier)
        average = torch.mul(kept[used[0]].delta, counted[used[0]] / total)
        for s in used[1:]:
            average.add_(kept[s].delta, alpha=counted[s] / total)
        return used, total, average

    def _counted_samples(self, used: dict[str, Part | Reduced], reference: float) -> dict[str, int]:
        """The samples each part (or row's average) weighs in with: those it claims, up to
        `max_samples_ratio` times the larger of the reference's and this replica's own. Claimed
        samples cannot be checked, and uncapped they would let one peer buy the average; its own
        in the bound, an owner never caps a part no larger than its own (joiners' shares of a round
        pulling the median down cap no full part)."""
        bound = self.cfg.max_samples_ratio * max(reference, used[self.me].samples if self.me in used else 0)
        if math.isinf(bound):  # (no cap asked for)
            return {sender: part.samples for sender, part in used.items()}
        cap = max(1, int(bound))
        for sender, part in used.items():
            if part.samples > cap:
                self.quiet.log(logging.WARNING, "capped", "%s from %s for round %d claims %d samples; counted as %d "
                               "(max_samples_ratio %g times the median's or this node's own): raise "
                               "--max-samples-ratio if batches differ that much", type(part).__name__.lower(),
                               sender[:8], self.round, part.samples, cap, self.cfg.max_samples_ratio)
                self.counters.capped += 1
        return {sender: min(part.samples, cap) for sender, part in used.items()}

    def _reference_samples(self, parts: dict[str, Part | Reduced]) -> float:
        """The samples parts are measured against: the median part's; with two there is no
        majority, and this replica trusts its own."""
        if len(parts) == 2:
            return max(1, parts[self.me].samples)
        return max(1, statistics.median(u.samples for u in parts.values()))

    def _average_row(self, c: int) -> list[Outgoing]:
        """Average the row's parts of column c. In one level that is the range's average, to send
        to the row; in two, each cell of it goes to that cell's owner."""
        used, total, average = self._average(self.parts[c])
        self.row_done.add(c)
        who, base = Contributors.of(self.group, used), self.state.version.hash
        lo, hi = self.layout.columns[c]
        if not self.layout.two_level:
            mine = Reduced(self.me, self.round, base, lo, hi, who, total, average)
            self._finish_cell(mine)
            return [Outgoing(mine, tuple(self._after_me(self._row_targets())))]
        out = []
        feedback = self.cfg.feedback and self.cfg.lossy
        if feedback and self.owed_rows is None:
            self.owed_rows = torch.zeros_like(self.state.params)
        for r, (a, b) in enumerate(self.layout.cells[c]):
            piece = Reduced(self.me, self.round, base, a, b, who, total, average[a - lo:b - lo])
            if feedback:  # (as for cells: what the codec lost of this piece last time travels in it)
                piece.delta.add_(self.owed_rows[a:b])
            decoded = self.wire(piece.delta.contiguous())
            if feedback:
                torch.sub(piece.delta, decoded, out=self.owed_rows[a:b])
            if r == self.row:
                self.partials[a, b][self.me] = replace(piece, delta=decoded)
            else:
                out.append(Outgoing(piece, (self.layout.owner(r, c),)))
        return out

    def _average_cell(self, c: int, cell: tuple[int, int]) -> Outgoing:
        """Average the rows' averages of this replica's cell of column c: the cell's average, to send
        to the column and to the row."""
        kept = self.partials[cell]
        used, total, average = self._average(kept)
        names = sorted(set().union(*(kept[s].contributors.names(self.group) for s in used)))
        mine = Reduced(self.me, self.round, self.state.version.hash, *cell, Contributors.of(self.group, names),
                       total, average)
        self._finish_cell(mine)
        rows = self.layout.rows
        column = {self.layout.owner(r, c) for r in range(len(rows))}
        # a row whose average did not come has lost its column owner, who would pass this cell on:
        # its members get it from here
        orphans = {m for r in range(len(rows)) if self.layout.owner(r, c) not in kept for m in rows[r]}
        return Outgoing(mine, tuple(self._after_me((column | orphans | set(self._row_targets())) - {self.me})))

    def _finish_cell(self, mine: Reduced) -> None:
        """A cell's average, computed here: keep it as the replicas will decode it, with the digests of
        the state's leaves within the cell once it is applied, which go with it."""
        decoded = self._decoded(mine.delta, mine.lo, mine.hi)
        self._step(decoded, mine.lo, mine.hi)
        leaves = leaf_range(mine.lo, mine.hi, self.n_params)
        vectors = [self.next_params] if self.next_momentum is None else [self.next_params, self.next_momentum]
        mine.leaves = b"".join(d for v in vectors for d in leaf_digests(v, leaves))
        self.reduced[mine.lo, mine.hi] = replace(mine, delta=decoded)
        self.sent_cells[mine.lo, mine.hi] = mine

    def _decoded(self, average: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """What every replica will use of an average this replica computed: as its peers decode it
        (in two levels decoded once more, as the column owners who pass it on send what they
        decoded). With error feedback, what the codec lost of this range's last average is added
        to it first (so travels in it), and what it loses now is kept for the next."""
        feedback = self.cfg.feedback and self.cfg.lossy
        if feedback:
            if self.owed is None:
                self.owed = torch.zeros_like(self.state.params)
            average.add_(self.owed[lo:hi])
        decoded = self.wire(average)
        if self.layout.two_level and self.cfg.lossy:
            decoded = self.wire(decoded)
        if feedback:
            torch.sub(average, decoded, out=self.owed[lo:hi])
        return decoded

    def _after_me(self, names: Iterable[str]) -> list[str]:
        """`names` in the order this replica sends to them: sorted, starting after its own name, so
        that members send to different peers first (as a ring does) rather than all to the same
        one, whose reads would then pace everyone's first sends."""
        ordered = sorted(names)
        first = bisect.bisect_right(ordered, self.me)
        return ordered[first:] + ordered[:first]

    def _row_targets(self) -> list[str]:
        """Who gets the cells this replica sends or passes on: its row, and the others whose parts
        came to it, in time or late (joiners assigned to its row: they get the round's result, so
        are on its state for the next), itself aside. A peer that sent no part gets none: it fetches
        the state when it wants it."""
        return sorted((set(self.layout.rows[self.row]) | self.senders) - {self.me})

    def _own_cells(self) -> list[tuple[int, int]]:
        return [self.layout.cells[c][self.row] for c in self.mine]

    def _pending(self) -> bool:
        """Whether a cell this replica owns is neither averaged nor given up."""
        return any(cell not in self.reduced and cell not in self.given_up for cell in self._own_cells())

    def deadline(self) -> float | None:
        """The next time something is due: averaging a row's parts, a column's cells, or closing."""
        if self.ready_at is None:
            return None
        if any(c not in self.row_done for c in self.mine):
            return self._due_at("row")
        if self._pending():
            return self._due_at("cell")
        return self._due_at("close")

    def can_close(self, now: float, gone: set[str] = frozenset()) -> bool:
        """Own cells averaged (or given up), and every cell in, or the deadline. A cell whose owner is
        `gone` (its connection closed) is not waited for if it would have come from the owner itself;
        one passed on by a column owner might still come (its owner may have sent it before going)."""
        if self.ready_at is None or self._pending():
            return False
        waiting = [1 for c, r, cell in self.layout.all_cells()
                   if cell not in self.reduced and not (self.layout.owner(r, c) in gone and self._direct(c, r))]
        return not waiting or now >= self._due_at("close")

    def _direct(self, c: int, r: int) -> bool:
        """Whether column c's cell for row r comes to this replica from its owner (not passed on)."""
        relay = self.layout.owner(self.row, c)
        return relay in (self.me, self.layout.owner(r, c))

    def _sent(self, c: int) -> torch.Tensor:
        """This replica's part of column c as its owner decoded it."""
        if c in self.mine:
            return self.parts[c][self.me].delta
        lo, hi = self.layout.columns[c]
        return self.wire(self.own[lo:hi].contiguous())

    def _step(self, average: torch.Tensor | None, lo: int, hi: int) -> None:
        """Values lo:hi of the next state, from the average there (None: none came)."""
        self.outer_step(average, lo, hi, self.next_params[lo:hi],
                        None if self.next_momentum is None else self.next_momentum[lo:hi])

    def close(self) -> Closed:
        """Assemble the averaged cells (the cells that did not come keep their values), move to the
        next round's shared state."""
        params, momentum = self.next_params, self.next_momentum
        carry = None
        names_of: dict[Contributors, set[str]] = {}  # (cells mostly share their contributors)
        values: dict[Contributors, int] = {}  # how many values of the vector each set of contributors averaged
        weighted, owners_missing = 0, set()
        sent: dict[int, torch.Tensor] = {}  # column -> this replica's part there as decoded (error feedback)
        for c, r, (lo, hi) in self.layout.all_cells():
            got = self.reduced.get((lo, hi))
            if got is None:
                self._step(None, lo, hi)
                owners_missing.add(self.layout.owner(r, c))  # (not in step with this replica)
                names = set()
            else:
                if got.contributors not in names_of:
                    names_of[got.contributors] = set(got.contributors.names(self.group))
                names = names_of[got.contributors]
                values[got.contributors] = values.get(got.contributors, 0) + hi - lo
                weighted += got.samples * (hi - lo)
            if got is None or self.me not in names:  # not averaged: stays this replica's progress
                carry = torch.zeros_like(params) if carry is None else carry
                carry[lo:hi] = self.own[lo:hi]
            elif self.cfg.feedback and self.cfg.lossy:  # averaged as its owner decoded it: carry the rest
                carry = torch.zeros_like(params) if carry is None else carry
                if c not in sent:
                    sent[c] = self._sent(c)
                start = self.layout.columns[c][0]
                carry[lo:hi] = self.own[lo:hi] - sent[c][lo - start:hi - start]
        if any(cell not in self.reduced for cell in self.lent):  # (its frame may still be arriving: it keeps
            params = params.clone()                               # the memory it was lent to itself)
        not_in = tuple(cell for _, _, cell in self.layout.all_cells() if cell not in self.reduced)
        self.counters.missing += len(not_in)
        share: dict[str, int] = {}
        for who, n in values.items():
            for name in names_of[who]:
                share[name] = share.get(name, 0) + n
        averaged = sum(values.values())
        used = sorted(name for name, n in share.items() if 2 * n >= averaged and name not in owners_missing)
        # samples added: those behind each cell, weighted by its size (a missing cell adds none)
        version = Version(self.round + 1, self.state.version.samples + weighted // self.n_params,
                          tree_hash(self.n_params, momentum is not None, self._state_leaves(params, momentum)))
        self.state = SharedState(version, params, momentum)
        self.counters.rounds += 1
        self.synced = self.me in used  # a member of the next group only if its parts made half the values
        self.expected = (set(used) | self._in_step()) - {self.me}
        rejected, ready_at = self.rejected, self.ready_at
        self._start_round()
        return Closed(self.state, used, rejected, carry, not_in, ready_at)

    def outer_step(self, average: torch.Tensor | None, lo: int, hi: int, params: torch.Tensor,
                   momentum: torch.Tensor | None) -> None:
        """Range lo:hi of the new parameters (and outer momentum), written into `params` (and
        `momentum`), hi - lo values each, from the averaged update there (None: it did not arrive, so
        no update): plain averaging, or Nesterov momentum on it. Range by range, as the ranges are
        assembled: one pass over the vector, and no vector of the average."""
        base = self.state.params[lo:hi]
        if average is None:
            average = torch.zeros_like(base)
        if self.cfg.outer == "average":
            torch.add(base, average, out=params)
            return
        old = self.state.momentum[lo:hi] if self.state.momentum is not None else torch.zeros_like(base)
        mu = self.cfg.outer_momentum
        torch.add(mu * old, average, out=momentum)
        torch.add(base, self.cfg.outer_lr * (average + mu * momentum), out=params)

    def _state_leaves(self, params: torch.Tensor, momentum: torch.Tensor | None) -> list[bytes]:
        """The digests of every leaf of the new state: for the cells that came, those their owners
        sent (this replica's own as it computed them), checked on a random sample of the received
        cells' leaves (`_checked`); it hashes the rest itself (leaves across two cells, missing cells)."""
        vectors = [params] if momentum is None else [params, momentum]
        known: list[dict[int, bytes]] = [{} for _ in vectors]  # per vector: leaf -> its digest
        checked = self._checked()
        for cell, got in self.reduced.items():
            leaves = leaf_range(*cell, self.n_params)
            sent = [got.leaves[k : k + DIGEST] for k in range(0, len(got.leaves), DIGEST)]
            sample = [leaves[k] for k in checked.get(cell, ())]
            mine = [d for v in vectors for d in leaf_digests(v, sample)]
            if mine != [sent[side * len(leaves) + i - leaves.start] for side in range(len(vectors)) for i in sample]:
                mine = [d for v in vectors for d in leaf_digests(v, leaves)]
                owner = self.layout.owner(self.cell_at[cell][1], self.cell_at[cell][0])
                self.quiet.log(logging.WARNING, "forged", "cell %d:%d of round %d (its owner %s, from %s): its "
                               "leaf digests are not those of its values; this replica's state hash uses its own",
                               *cell, self.round, owner[:8], got.sender[:8])
                self.counters.forged += 1
                sent = mine
            for side in range(len(vectors)):
                known[side].update(zip(leaves, sent[side * len(leaves) : (side + 1) * len(leaves)], strict=True))
        out = []
        for vector, digests in zip(vectors, known, strict=True):
            todo = [i for i in range(-(-self.n_params // LEAF)) if i not in digests]
            digests.update(zip(todo, leaf_digests(vector, todo), strict=True))
            out += [digests[i] for i in range(len(digests))]
        return out

    def _checked(self) -> dict[tuple[int, int], list[int]]:
        """The leaves whose digests this replica checks this round: CHECKED_LEAVES picked at random
        among those of the cells it received (from others), as cell -> positions in its leaf range."""
        cells = sorted(cell for cell, got in self.reduced.items() if got.sender != self.me and got.leaves)
        sizes = [len(leaf_range(*cell, self.n_params)) for cell in cells]
        out: dict[tuple[int, int], list[int]] = {}
        for k in sorted(self.rng.sample(range(sum(sizes)), min(CHECKED_LEAVES, sum(sizes)))):
            i = 0
            while k >= sizes[i]:
                k, i = k - sizes[i], i + 1
            out.setdefault(cells[i], []).append(k)
        return out

    def _norm_outliers(self, parts: dict[str, Part | Reduced], ref_samples: float) -> dict[str, str]:
        """Parts (or rows' averages) whose norm is more than max_norm_ratio away from the median norm
        (its own too: an owner must not push its own outlier into a range everyone uses). With two
        there is no majority, and this replica trusts its own.

        The band's low end comes down with the samples behind a part against the reference's: an
        honest update of a share of a round's steps (a joiner's first) is that much smaller, and
        claiming fewer samples only lowers a part's weight. Its high end stays: claimed samples are
        not trusted to let a larger part in. (`ref_samples`: the parts' `_reference_samples`.)"""
        if len(parts) < 2:
            return {}
        norms = {s: norm(u.delta) if u.norm is None else u.norm for s, u in parts.items()}
        two = len(norms) == 2
        ref = norms[self.me] if two else statistics.median(norms.values())
        ratio, out = self.cfg.max_norm_ratio, {}
        for sender, size in norms.items():
            share = min(1.0, parts[sender].samples / ref_samples)
            if not (two and sender == self.me) and ref > 0 and not ref / ratio * share <= size <= ref * ratio:
                out[sender] = f"norm {size:.3g} is far outside its peers' ({ref:.3g})"
        return out

    # --- versions -----------------------------------------------------------------------------------

    def note_version(self, peer: str, version: Version, synced: bool, joining: bool = False) -> None:
        """A peer announced its version; `synced` when it got there by closing a round whose every range
        its parts went into (or holds genesis), and is still training; `joining` when it is not, but
        trains and will send its parts in the round that starts from that version (`_joining`).

        Peers in step (synced, on this replica's version) are members of its next group; a peer
        that fetched the state (a joiner, a restarted node) is not, until it has contributed. (Same
        version, same cells, same contributors: the peers in step with a replica are those its own
        round found. A member that drops out is not struck from the group here, since peers that
        heard of it before fixing their group and peers that heard after would lay out different
        groups: it misses the round, whose deadline passes, and so is not in the next.)
        """
        self.announced[peer] = (version, synced)
        if synced and version == self.state.version:
            self.expected.add(peer)
        if joining and not synced:
            self.joiners[peer] = version
        else:
            self.joiners.pop(peer, None)

    def members(self) -> list[str]:
        """The group of the round that starts from this replica's state, as it knows it now."""
        return sorted(self.expected | ({self.me} if self.synced else set()))

    def _next_layout(self) -> Layout:
        """The layout of the round that starts from this replica's state, as it knows the group now."""
        return Layout.of(self.members() or [self.me], self.n_params, self.cfg.flat)

    def row_peers(self) -> list[str]:
        """The peers this replica will send its parts to in the round that starts from its state (its
        row, laid out as its peers lay it out). A joiner announces its version to them, so that they
        wait for its parts (`_joining`)."""
        layout = self._next_layout()
        return [p for p in layout.rows[layout.row_of(self.me)] if p != self.me]

    def partners(self) -> set[str]:
        """The peers this replica exchanges with in its round and in the next, as far as it knows the
        next group: its row, and the owners of its column in the other rows (a node keeps its
        connections to them open)."""
        out = set()
        for layout in [self.layout, self._next_layout()] if self.layout else [self._next_layout()]:
            out.update(layout.rows[layout.row_of(self.me)])
            out.update(layout.owner(r, c) for c in layout.owned(self.me) for r in range(len(layout.rows)))
        return out - {self.me}

    def _joining(self) -> set[str]:
        """Peers not in the group that announced they join from this replica's state and send their
        parts to its row (joiners, restarted nodes; not a node that finished training). A row owner
        waits for their parts as for its row's, up to the row stage's time: otherwise a joiner's
        part counts only if it beats the row's last member, and joiners take many rounds to become
        members."""
        return {p for p, v in self.joiners.items()
                if v == self.state.version and p not in self.layout.where and self.layout.row_of(p) == self.row}

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
        new state's base, which count again. Its next group is the one the holder named (else the
        peers it heard are in step on that state): the replica lays out the same rows as they do, and
        is a member only if that group counts it (its parts made the round, and it only missed
        cells that the holder got); otherwise not until it has contributed.
        """
        progress = local - self.state.params
        if self.own is not None:
            progress -= self.own
        rebased = state.params + progress
        self.state = state
        self.counters.adopted += 1
        self.owed = self.owed_rows = None  # (errors of ranges averaged on the old state)
        named = set(state.members or ())
        self.synced = self.me in named
        self.expected = (named | self._in_step()) - {self.me}
        self.held = {k: (m, at) for k, (m, at) in self.held.items() if m.round >= self.round}
        self._start_round()
        return rebased
