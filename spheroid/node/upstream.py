"""The earlier blocks a block's trainer reads, kept fresh from their holders (upstream.py), and the
holder's side of refreshes by change.

A block that reads the blocks before it (chain states, the relay channel) holds frozen copies of
them. Their holders announce their versions to it too; it fetches the preferred version of each
(hash verified, from a holder chosen by rendezvous hashing) when it starts and then at most every
`refresh_every` steps, between training chunks (`Upstream`). Nobody waits for anybody: until a
block's first fetch its copy is the genesis state. The versions read go into the checkpoint and
the status. With `refresh_codec` other than fp32 a refresh asks for the change from the copy it
holds (named by the hash of its parameters) to the holder's state, in that codec. The copy
becomes close to the version, not exact; but the holder computes the copy that change makes as
the reader will, and keeps it (`ReadersCopies`: the last COPIES it made), so the next change is
taken from the reader's actual copy and what rounding lost is sent then: the copy's error stays
that of one change, it does not build up. A holder without the reader's copy (another holder, or
one that forgot it) sends a snapshot.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time

import torch
from torch.nn.utils import parameters_to_vector

from ..averaging import SharedState, Version, confirmed, state_hash
from ..config import RunConfig, part_name
from ..status import UpstreamStatus
from ..train import EarlierBlocks
from ..wire import ProtocolError, through_codec
from ..wire.tensors import TENSOR_CODECS
from .client import StateDelta, request_state
from .connection import PeerGone
from .node import Node

log = logging.getLogger(__name__)

COPIES = 64  # readers' copies a holder keeps (the last it made), to send the change from them,
COPIES_BYTES = 256 << 20  # and at most this many bytes of them
DONOR_WAIT_S = 3.0  # a reader waits this long for the holder that made its copy to announce a version
FETCH_RETRY_S = 1.0  # a reader whose fetch of an earlier block failed (its holders busy) tries again after this


def pick_donor(me: str, holders: list[str]) -> str:
    """Rendezvous hashing: each joiner ranks the holders of a state its own way, so joiners spread."""
    return max(holders, key=lambda h: hashlib.sha256((me + h).encode()).digest())


def peers_of(node: Node, block: int) -> set[str]:
    """The connected peers that hold `block`: whose announcements confirm its versions (`trust.confirmed`)."""
    return {conn.label for conn in node.peers_holding(block)}


def same_run(a: RunConfig, b: RunConfig) -> bool:
    """Whether two replicas train the same model under the same noise schedule."""
    return a.model == b.model and a.noise == b.noise


async def fetch_from(node: Node, holders: list[str], block: int, n_params: int, cfg: RunConfig,
                     since: str | None = None, codec: str | None = None,
                     prefer: str | None = None) -> tuple[str, SharedState | StateDelta] | None:
    """(donor, block `block`'s state) from the first of `holders` (`prefer` first if it is one, then
    in this node's rendezvous order) that sends a verified one of the same model and noise schedule
    (or, asked `since` parameters in `codec`, maybe the change from them); None if none does."""
    holders = list(holders)
    while holders:
        donor = prefer if prefer in holders else pick_donor(node.id, holders)
        holders.remove(donor)
        conn = node.conns.get(donor)
        if conn is None:
            continue
        try:
            run_cfg, state = await request_state(conn, block, n_params, since, codec)
            if not same_run(run_cfg, cfg):
                raise ValueError("its model or noise schedule differs from this node's")
        except Exception as exc:  # (whatever one holder sent: the next one is asked)
            log.warning("state of %s from %s refused: %s", part_name(block), donor[:8], exc,
                        exc_info=not isinstance(exc, PeerGone | ProtocolError | ValueError | TypeError))
            continue
        log.info("fetched %s's state %s (round %d) from %s", part_name(block), state.version.hash[:12],
                 state.version.round, donor[:8])
        return donor, state
    return None


class ReadersCopies:
    """A holder's side of refreshes by change: the copies it made for readers, so that the next
    change it sends a reader starts from the copy the reader actually holds.

    It keeps the last COPIES copies it made, at most COPIES_BYTES of them (a reader's copy is
    replaced by the next one it asks for, so that is about that many readers). Thread-safe: the
    worker computes changes off the event loop."""

    def __init__(self, limit: int = COPIES, limit_bytes: int = COPIES_BYTES) -> None:
        self.limit, self.limit_bytes = limit, limit_bytes
        self.copies: dict[str, torch.Tensor] = {}  # by the hash of the parameters, the oldest made first
        self.lock = threading.Lock()

    def knows(self, since: str | None) -> bool:
        """Whether it holds a copy it made with these parameters' hash (on the event loop: no lock,
        which `change` holds only to look up and store; a dict lookup is atomic)."""
        return since in self.copies

    def change(self, since: str, known: dict[str, tuple[int, torch.Tensor]], params: torch.Tensor, round: int,
               codec: str) -> tuple[torch.Tensor, str] | None:
        """(the change from the parameters hashed `since` to `params`, at `round`, and the wire codec
        to send it in); None if this holder knows neither a copy it made nor one of `known` (by hash:
        the round and parameters of genesis and of its recent states) by that hash. The change goes
        in `codec` (its name on the wire), except one from a known state more than a round older (a
        reader that joined late, or switched holders): a coarse codec gives way to its `catch_up` there
        (int4 and int2 to int8), since that change is many rounds' worth and what the coarse codecs lose
        of it would take rounds to send. Keeps the copy the reader will make (the change as decoded,
        added as it adds it)."""
        with self.lock:  # (only around the dict: changes for several readers run at once)
            base = self.copies.get(since)
        if base is None and since in known:
            base_round, base = known[since]
            codec = (TENSOR_CODECS[codec].catch_up or codec) if round - base_round > 1 else codec
        if base is None:
            return None
        change = params - base
        copy = base + through_codec(change, codec)
        key = state_hash(copy)
        with self.lock:
            self.copies[key] = copy
            while len(self.copies) > max(1, min(self.limit, self.limit_bytes // (4 * params.numel()))):
                del self.copies[next(iter(self.copies))]
        return change, codec


class Upstream:
    """The frozen copies of the earlier blocks a worker reads, kept near the swarm's preferred versions.

    Holders of blocks 0..b-1 announce their versions to block b's nodes as to their own replicas.
    `refresh`, called when a version of an earlier block is announced and after each of this
    node's rounds, fetches in the background each earlier block whose preferred confirmed version
    (announced by two holders, or by every holder heard: `trust.confirmed`, so that no one holder
    moves a copy) is preferred over the one held (a copy never goes back: a state sent behind it,
    or of a version not confirmed, is refused), if it was not fetched in the last three quarters of
    `every` steps (so about once per `every` steps, whatever the jitter of the announcements; a
    fetch that failed, its holders busy, is tried again FETCH_RETRY_S later); `apply` swaps the
    fetched ones in between training steps (the training thread reads the copies), so a copy is as
    fresh as the transfer allows, not a round late. With a `codec` other than fp32 it asks for the
    change from the copy it holds, named by its parameters' hash (see the module's docstring), and
    waits up to DONOR_WAIT_S for the holder that made that copy if the version came from another
    first: any other would send a snapshot.
    """

    def __init__(self, node: Node, block: int, earlier: EarlierBlocks | None, every: int, codec: str = "fp32") -> None:
        self.node, self.block, self.earlier, self.every, self.codec = node, block, earlier, every, codec
        self.announced: dict[int, dict[str, Version]] = {b: {} for b in range(block)} if earlier else {}
        self.held: dict[int, Version] = {}  # the version each copy was fetched at
        # the hash of each copy's parameters: at first its genesis parameters, which holders keep, so
        # that a first refresh by change needs no snapshot either
        self.copies: dict[int, str] = {}
        if earlier is not None and codec != "fp32":
            self.copies = {b: state_hash(parameters_to_vector(copy.parameters()).detach())
                           for b, copy in enumerate(earlier.blocks)}
        self.changes, self.snapshots = 0, 0  # refreshes applied, by change and by snapshot
        self.donors: dict[int, str] = {}  # the holder each copy last came from
        self.pending: dict[int, SharedState | StateDelta] = {}  # (filled on the event loop, emptied by `apply`)
        self.refreshed_at: dict[int, int] = {}  # the step each block was last fetched at
        self.failed: dict[int, float] = {}  # blocks whose last fetch failed -> when to try again (monotonic)
        # the version each block last waited for its donor to announce, and until when
        self.waited: dict[int, tuple[Version, float]] = {}
        self.step = 0  # this node's step, as of the last `refresh`
        self.fetching: asyncio.Task | None = None
        self.fetches, self.bytes = 0, 0

    def note(self, peer: str, block: int, version: Version) -> None:
        if block in self.announced:
            self.announced[block][peer] = version

    def refresh(self, step: int) -> asyncio.Task | None:
        """Start fetching the earlier blocks due a refresh, unless a fetch is under way (which
        looks again when it is done)."""
        self.step = step
        if not self.announced or (self.fetching and not self.fetching.done()):
            return None
        wanted = self._due()
        if not wanted:
            return None
        self.fetching = self.node.spawn(self._fetch(wanted))
        return self.fetching

    def _due(self) -> dict[int, list[str]]:
        """The earlier blocks to fetch now, with the live holders of the version to fetch (counted
        as fetched at this step)."""
        wanted = {}
        for b, peers in self.announced.items():
            last = self.refreshed_at.get(b)
            if b in self.failed:  # (a failed fetch is tried again within seconds, not after most of `every` steps)
                if time.monotonic() < self.failed[b]:
                    continue
            elif last is not None and 4 * (self.step - last) < 3 * self.every:
                continue
            live = {p: v for p, v in peers.items() if p in self.node.conns}
            best = None
            for version in live.values():  # (confirmed: no one holder moves this copy, `trust.confirmed`)
                if (best is None or version.preferred_over(best)) and confirmed(version, live, peers_of(self.node, b)):
                    best = version
            fetched, held = self.pending.get(b), self.held.get(b)
            if (best is None or not best.samples  # (0 samples: genesis)
                    or (held is not None and not best.preferred_over(held))  # (the copy held, or one behind it)
                    or (fetched is not None and fetched.version == best)):
                continue
            holders = [p for p, v in live.items() if v == best]
            donor = self.donors.get(b)
            if self.codec != "fp32" and donor in live and donor not in holders and self._wait_for_donor(b, best):
                continue
            wanted[b] = holders
            self.refreshed_at[b] = self.step
        return wanted

    def _wait_for_donor(self, b: int, best: Version) -> bool:
        """Whether to wait for the holder that made block b's copy to announce `best` (it most
        likely closes that round too, within the averaging deadline): yes for DONOR_WAIT_S after
        `best` was first seen without it, then looked at again."""
        now = time.monotonic()
        version, until = self.waited.get(b, (None, 0.0))
        if version != best:
            self.waited[b] = (best, now + DONOR_WAIT_S)
            self.node.spawn(self._refresh_after(DONOR_WAIT_S))  # (a node's tasks end when it stops)
            return True
        return now < until

    async def _refresh_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self.refresh(self.step)

    async def _fetch(self, wanted: dict[int, list[str]]) -> None:
        """Fetch these blocks, then any that came due meanwhile."""
        while wanted:
            await self._fetch_blocks(wanted)
            wanted = self._due()

    async def _fetch_blocks(self, wanted: dict[int, list[str]]) -> None:
        for b, holders in wanted.items():
            n_params = sum(p.numel() for p in self.earlier.blocks[b].parameters())
            since = self.copies.get(b)
            before, held, left, got = self._received(holders), self.held.get(b), list(holders), None
            while left:
                # (the holder that made this copy first: another would not know it and send a snapshot)
                got = await fetch_from(self.node, left, b, n_params, self.earlier.cfg, since,
                                       self.codec if since else None, prefer=self.donors.get(b))
                version = got[1].version if got is not None else None  # (a holder sends the state it holds now)
                if got is None or (confirmed(version, self.announced[b], peers_of(self.node, b))
                                   and (held is None or version.preferred_over(held))):
                    break
                log.warning("block %d's state from %s refused: round %d, not confirmed or not later than the copy "
                            "held (round %s); its announcement is forgotten", b, got[0][:8], version.round,
                            None if held is None else held.round)
                self.announced[b].pop(got[0], None)  # (not asked again until it announces again)
                left.remove(got[0])
                got = None
            self.bytes += self._received(holders) - before  # (the transfers, and any version notes meanwhile)
            if got is None:  # (its holders busy, gone or behind: looked at again then, announcement or not)
                self.failed[b] = time.monotonic() + FETCH_RETRY_S
                self.node.spawn(self._refresh_after(FETCH_RETRY_S))
            else:
                self.failed.pop(b, None)
                self.donors[b], self.pending[b] = got
                self.fetches += 1

    def _received(self, holders: list[str]) -> int:
        return sum(self.node.traffic.totals(h)["received"]["wire_bytes"] for h in holders)

    def apply(self) -> None:
        """Swap the fetched earlier blocks in (only in the training thread between steps, or with
        no training under way)."""
        for b in sorted(self.pending):
            got = self.pending.pop(b)  # (one at a time: the event loop may add more meanwhile)
            exact = not isinstance(got, StateDelta)
            if exact:
                params = got.params
                self.snapshots += 1
            elif got.since != self.copies.get(b):
                continue  # (a change from a copy replaced meanwhile)
            else:
                params = parameters_to_vector(self.earlier.blocks[b].parameters()).detach() + got.delta
                self.changes += 1
            self.earlier.replace(b, params, {**got.version.to_wire(), "exact": exact})
            self.held[b] = got.version
            if self.codec != "fp32":
                self.copies[b] = state_hash(params)
            log.info("block %d now reads block %d at round %d (state %s%s)", self.block, b, got.version.round,
                     got.version.hash[:12], "" if exact else f", close: a change in {self.codec}")

    def status(self) -> UpstreamStatus:
        reads = {name: dict(version) for name, version in self.earlier.versions.items()} if self.earlier else {}
        return UpstreamStatus(reads=reads, fetches=self.fetches, changes=self.changes, snapshots=self.snapshots,
                              bytes=self.bytes)
