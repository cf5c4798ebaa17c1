"""One replica's side of the rounds for one block, as a state machine driven from outside: its own
update in (`submit`), peers' messages in (`offer`), what to send when (`due`), the round's close
(`close`) into the next shared state and what it carries over. Its versions and group are
`Membership`'s; which parts count, `rule`'s; how the average moves the state, `outer`'s."""

from __future__ import annotations

import bisect
import logging
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch

from ..progress import QuietLog
from . import rule
from .config import AveragingConfig
from .layout import Layout
from .membership import Membership
from .outer import outer_step
from .parts import Contributors, Outgoing, Part, Reduced, group_digest
from .rule import norm
from .state import DIGEST, SharedState, Version, assembled_digests, checked_sample, leaf_digests, leaf_range, tree_hash
from .trust import Made, Pace

log = logging.getLogger(__package__)  # (the package's: spheroid.averaging)


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
class Replica(Membership):
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
        self.made: Made | None = None  # what it knows of the round that made its state, if it closed it (`trust`)
        self.refused: set[Version] = set()  # versions whose fetched state it refused since its state changed
        self.pace = Pace()  # how fast its rounds go, and who was in its last round with others (`trust`)
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
        self.pace.submitted(self.round, now)
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
        """The average of what the rule lets count (`rule.average`), refusals and caps logged and
        counted: (senders used, samples, average)."""
        got = rule.average(kept, self.me, self.cfg)
        for sender, reason in got.rejected.items():
            self.quiet.log(logging.WARNING, "outlier", "%s from %s for round %d refused: %s",
                           type(kept[sender]).__name__.lower(), sender[:8], self.round, reason)
            self.counters.rejected += 1
        self.rejected.update(got.rejected)
        for sender, cap in got.capped.items():
            self.quiet.log(logging.WARNING, "capped", "%s from %s for round %d claims %d samples; counted as %d "
                           "(max_samples_ratio %g times the median's or this node's own): raise "
                           "--max-samples-ratio if batches differ that much", type(kept[sender]).__name__.lower(),
                           sender[:8], self.round, kept[sender].samples, cap, self.cfg.max_samples_ratio)
            self.counters.capped += 1
        return got.used, got.samples, got.average

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
        outer_step(self.cfg, self.state, average, lo, hi, self.next_params[lo:hi],
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
        base, self.state, self.refused = self.state, SharedState(version, params, momentum), set()
        # a cell counts no part for more than it claims: at most the contributors times the largest claim
        claims = [self.own_samples, *(p.samples for parts in self.parts.values() for p in parts.values())]
        cap = max([len(set(self.group) | self.senders | set().union(*names_of.values())) * max(claims)]
                  + [got.samples for got in self.reduced.values()])
        cells = [cell for _, _, cell in self.layout.all_cells()]
        self.made = Made.of(base, self.state, cells, not_in, cap) if len(not_in) < len(cells) else None
        self.pace.closed_round(version.round, self.ready_at, set(used) - {self.me}, weighted // self.n_params)
        self.counters.rounds += 1
        self.synced = self.me in used  # a member of the next group only if its parts made half the values
        self.expected = (set(used) | self._in_step()) - {self.me}
        rejected, ready_at = self.rejected, self.ready_at
        self._start_round()
        return Closed(self.state, used, rejected, carry, not_in, ready_at)

    def _state_leaves(self, params: torch.Tensor, momentum: torch.Tensor | None) -> list[bytes]:
        """The digests of every leaf of the new state: for the cells that came, those their owners
        sent (this replica's own as it computed them), checked on a random sample of the received
        cells' leaves; it hashes the rest itself (leaves across two cells, missing cells)."""
        received = sorted(cell for cell, got in self.reduced.items() if got.sender != self.me and got.leaves)
        checked = checked_sample(received, self.n_params, self.rng)
        digests, forged = assembled_digests([params] if momentum is None else [params, momentum],
                                            {cell: got.leaves for cell, got in self.reduced.items()}, checked)
        for cell in forged:
            owner = self.layout.owner(self.cell_at[cell][1], self.cell_at[cell][0])
            self.quiet.log(logging.WARNING, "forged", "cell %d:%d of round %d (its owner %s, from %s): its "
                           "leaf digests are not those of its values; this replica's state hash uses its own",
                           *cell, self.round, owner[:8], self.reduced[cell].sender[:8])
            self.counters.forged += 1
        return digests
