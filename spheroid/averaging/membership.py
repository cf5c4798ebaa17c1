"""Who a replica's next group is, and which state the swarm keeps: the versions peers announce,
which of them are in step (members of the next group) or joining, and the one rule that settles
diverged states (`Version.preferred_over`), with adopting a preferred state. A part of `Replica`
(its base class), apart from the rounds themselves."""

from __future__ import annotations

import torch

from .layout import Layout
from .state import SharedState, Version


class Membership:
    """`Replica`'s versions and group: the methods here read and set its `announced`, `joiners`,
    `expected` and `synced`, and `adopt` restarts its round on a fetched state."""

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
