"""Who a replica's next group is, and which state the swarm keeps: the versions peers announce,
which of them are in step (members of the next group) or joining, the one rule that settles
diverged states (`Version.preferred_over`), which preferred states it may take (`trust`: confirmed,
or checked against the round that made its own), and adopting one. A part of `Replica` (its base
class), apart from the rounds themselves."""

from __future__ import annotations

import logging
from collections.abc import Collection

import torch

from .layout import Layout
from .state import SharedState, Version
from .trust import UNCONFIRMED, confirmed


class Membership:
    """`Replica`'s versions and group: the methods here read and set its `announced`, `joiners`,
    `expected`, `synced`, `made` and `refused`, and `adopt` restarts its round on a fetched state."""

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

    def trusts(self, version: Version, live: Collection[str] | None = None, now: float | None = None) -> bool:
        """Whether a preferred version may be fetched: confirmed by the peers' announcements (`live`,
        if given: the peers of the block there, `trust.confirmed`); or, in no group, a later round
        one peer of its last round can have reached by `now` (`_ahead`); or a state of the round that
        made this replica's with no more samples than that round could count (its values are checked
        once fetched: `vet`). Not a version whose fetched state this replica refused since its state
        last changed round."""
        if version in self.refused:
            return False
        made = self.made
        return (self._confirmed(version, live) or self._ahead(version, live, now)
                or (made is not None and made.plausible(version)))

    def takes(self, version: Version, live: Collection[str] | None = None, now: float | None = None) -> bool:
        """Whether a fetched state of this version is one to adopt now: wanted and trusted."""
        return self.wants(version) and self.trusts(version, live, now)

    def _ahead(self, version: Version, live: Collection[str] | None, now: float | None) -> bool:
        """A later round, for a replica in no group (done training, or out of its last round): held by
        a peer that contributed to its last round with others, and one it can have reached (`Pace`)."""
        holders = {p for p, (v, _) in self.announced.items() if v == version and (live is None or p in live)}
        return (not self.synced and not holders.isdisjoint(self.pace.peers)
                and self.pace.allows(version, self.state.version, now, self.cfg.max_samples_ratio))

    def _confirmed(self, version: Version, live: Collection[str] | None) -> bool:
        peers = None if live is None else [p for p in live if p != self.me]
        return confirmed(version, {peer: v for peer, (v, _) in self.announced.items()}, peers)

    def choice(self, in_round: bool = False, live: Collection[str] | None = None,
               now: float | None = None) -> Version | None:
        """The version to fetch: the preferred one of those announced (by `live` peers) that this
        replica wants and trusts; None if none."""
        best = None
        for peer, (version, _) in self.announced.items():
            if ((live is None or peer in live) and (best is None or version.preferred_over(best))
                    and self.wants(version, in_round) and self.trusts(version, live, now)):
                best = version
        return best

    def vet(self, state: SharedState, live: Collection[str] | None = None, now: float | None = None) -> str | None:
        """Why a fetched state may not replace this replica's; None if it may. UNCONFIRMED: not yet
        (its version is not confirmed, and not one of the round that made this replica's state: its
        holders may confirm it later). A state of that round that is not what the round could have
        made is refused, and its version is not fetched again while this replica's state stays."""
        if not self.wants(state.version):
            return "not preferred"
        if state.version in self.refused:
            return "refused already"
        if self._confirmed(state.version, live) or self._ahead(state.version, live, now):
            return None
        if self.made is None or not self.made.plausible(state.version):
            return UNCONFIRMED
        reason = self.made.inconsistency(state, self.cfg.max_norm_ratio)
        if reason is not None:
            if len(self.refused) >= 64:  # (a bound: each one cost its sender a state transfer)
                self.refused.clear()
            self.refused.add(state.version)
            self.quiet.log(logging.WARNING, "untrusted", "state %s of round %d (%d samples) refused: %s",
                           state.version.hash[:12], state.version.round, state.version.samples, reason)
        return reason

    def adopt(self, state: SharedState, local: torch.Tensor) -> torch.Tensor:
        """Take a fetched state; returns `local` rebased onto it.

        Progress not yet sent is kept; progress already sent as this round's update is not carried
        over (the adopted state may include it already; if it does not, it was late). This round's
        parts and ranges were relative to the old state and are dropped, except held ones on the
        new state's base, which count again. Its next group is the one the holder named (else the
        peers it heard are in step on that state): the replica lays out the same rows as they do, and
        is a member only if that group counts it (its parts made the round, and it only missed
        cells that the holder got); otherwise not until it has contributed. A state of the round
        that made its own keeps what it knows of that round (`made`): one with more of its cells
        may still follow.
        """
        progress = local - self.state.params
        if self.own is not None:
            progress -= self.own
        rebased = state.params + progress
        if self.made is None or state.version.round != self.made.round:  # (of another round: nothing to check it by)
            self.made, self.refused = None, set()
        self.state = state
        self.counters.adopted += 1
        self.owed = self.owed_rows = None  # (errors of ranges averaged on the old state)
        named = set(state.members or ())
        self.synced = self.me in named
        self.expected = (named | self._in_step()) - {self.me}
        self.held = {k: (m, at) for k, (m, at) in self.held.items() if m.round >= self.round}
        self._start_round()
        return rebased
