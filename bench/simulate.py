"""A large swarm's averaging rounds, simulated: spheroid/averaging.py under a fake clock and network.

N nodes train B blocks (N / B replicas each). Each node is a `Replica` (the same sans-I/O code a
node runs); "training" a round takes the node's compute time (stragglers take 5 times as long; the
others 0.9 to 1.1 times `compute_s`) and adds a seeded increment. Every message (a part, an average,
a version, a state transfer) arrives after the link's latency plus its size over the bandwidth,
unless the two nodes are on different sides of the partition or the receiver has left. Sizes count
as if a block were `block_bytes` (the simulated vector is short: what is simulated is how many
messages go where). A node that leaves is gone at once to its peers (its connections close); a
partitioned peer is not (it is waited for until the deadline). Each node keeps standing
connections to `links` random peers of its block (and dials new ones for those that leave, the
two ends exchanging versions on them); it announces its version on them and to the
peers it averaged with in its last round (its row and column), and a node that fetches a
preferred version announces it in turn, so versions spread from peer to peer, never to the whole
block. Churn: every simulated minute a fraction of the nodes leaves and as many fresh ones join
with no state; a joiner hears the versions of the live same-block nodes after a gossip delay and
fetches the preferred state, with the group of its next round and the share of that round its
holder had left to train, from one holder, as a node does; it trains that share, so that its parts
come with its holder's round.
One partition splits every block in two halves for a while and then heals.

It reports (and writes as JSON): rounds closed; the share closed by their deadline; that replicas
that closed a round of one group with the same cells always hold the same state; of the replicas
closing a round, and of the members of its main group, the share on its most common state, and
that group's size; how many joiners became members (of all, and of those that joined two rounds
before training stopped) and how long they took to their first round as members; the bytes (also over
the block's size) and the peers each node sent to in a round (parts and averages; with versions
and state transfers, the peers apart); and how many distinct states each block held at the end,
after the swarm settled.

Writes JSON (--out; default runs/simulate.json: the committed result was written with --out
bench/results/simulate.json), with the commit and command that made it.

    python bench/simulate.py [--nodes 1000] [--blocks 4] [--minutes 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import logging
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from provenance import provenance  # noqa: E402

from spheroid.averaging import AveragingConfig, Part, Reduced, Replica, SharedState, Version  # noqa: E402
from spheroid.node.upstream import pick_donor  # noqa: E402

log = logging.getLogger("bench.simulate")
logging.getLogger("spheroid.averaging").setLevel(logging.ERROR)  # refusals are counted, not logged


SAMPLES = 16  # behind a round's local steps


@dataclass
class Config:
    nodes: int = 1000
    blocks: int = 4
    params: int = 1024  # values per block (small: the message count, not their size, is what is simulated)
    block_bytes: int = 16 << 20  # ... but sizes count as if a block were this big (4M float32 values)
    compute_s: float = 20.0  # one round's local steps
    wait_s: float = 10.0  # the round deadline (half of it, the first stage, covers the spread of compute times)
    latency_s: float = 0.05
    mbit: float = 100.0
    churn: float = 0.10  # of the nodes, leaving (and as many joining) per simulated minute
    stragglers: float = 0.05  # nodes 5x slower
    gossip_s: float = 3.0  # until a joiner has heard its block's members
    links: int = 8  # same-block peers a node connects to when it starts (and is connected to by later ones)
    minutes: float = 6.0
    partition: tuple[float, float] = (120.0, 180.0)  # seconds: every block split in two halves
    settle_s: float = 150.0  # then no training starts (a straggler may still finish a round); versions settle
    seed: int = 0


@dataclass
class Member:
    name: str
    block: int
    replica: Replica
    local: torch.Tensor
    compute: float
    joined: float
    side: int
    alive: bool = True
    token: int = 0  # of its current training run
    trained_at: float | None = None  # when its current training run ends (None: not training)
    samples: int = SAMPLES  # behind its current training run
    fetching: bool = False  # a state transfer to it is under way (a node runs one at a time)
    first_member_round: float | None = None
    sent: dict[int, list] = field(default_factory=dict)  # round -> [bytes, peers] of its averaging messages
    talked: dict[int, set] = field(default_factory=dict)  # round -> every peer it sent anything to
    links: set[str] = field(default_factory=set)  # its standing connections to same-block peers


class Swarm:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.now = 0.0
        self.queue: list = []
        self.seq = itertools.count()
        self.rng = torch.Generator().manual_seed(cfg.seed)
        self.avg = AveragingConfig(wait=cfg.wait_s, every=1)
        self.genesis = {b: torch.randn(cfg.params, generator=torch.Generator().manual_seed(b))
                        for b in range(cfg.blocks)}
        self.members: dict[str, Member] = {}
        self.names = (f"{i:032x}" for i in itertools.count())
        self.closes: list[dict] = []
        self.partitioned = False
        self.stop_at = cfg.minutes * 60.0
        self.other_bytes = 0  # versions and state transfers
        self.fetches = 0
        for i in range(cfg.nodes):
            self._add(i % cfg.blocks, genesis=True)
        for m in list(self.members.values()):
            self.link(m)
        for b in range(cfg.blocks):  # they start together from one genesis state and say so
            group = self.block_members(b)
            for m in group:
                for other in group:
                    if other is not m:
                        m.replica.note_version(other.name, other.replica.state.version, synced=True)
        for m in list(self.members.values()):
            self.train(m)
        for minute in range(int(cfg.minutes) if cfg.churn > 0 else 0):
            self.at(60.0 * minute + 30.0, self.churn)
        self.at(cfg.partition[0], self.split, True)
        self.at(cfg.partition[1], self.split, False)

    # --- the event queue ---------------------------------------------------------------------------

    def at(self, delay: float, fn, *args) -> None:
        heapq.heappush(self.queue, (self.now + delay, next(self.seq), fn, args))

    def run(self, until: float) -> None:
        while self.queue and self.queue[0][0] <= until:
            self.now, _, fn, args = heapq.heappop(self.queue)
            fn(*args)
        self.now = until

    def random(self) -> float:
        return float(torch.rand((), generator=self.rng))

    # --- membership --------------------------------------------------------------------------------

    def _add(self, block: int, genesis: bool) -> Member:
        name = next(self.names)
        state = SharedState.create(0, 0, self.genesis[block].clone(), None)
        slow = self.random() < self.cfg.stragglers
        compute = self.cfg.compute_s * (5.0 if slow else 1.0) * (0.9 + 0.2 * self.random())
        m = Member(name, block, Replica(name, state, self.avg, synced=genesis), state.params.clone(), compute,
                   self.now, side=int(self.random() < 0.5))
        self.members[name] = m
        return m

    def block_members(self, block: int) -> list[Member]:
        return [m for m in self.members.values() if m.alive and m.block == block]

    def link(self, m: Member, count: int | None = None) -> list[Member]:
        """Connect a node to `count` (default `links`) random live peers of its block that it is not
        connected to (both ways, as connections are); the peers it connected to."""
        others = [p for p in self.block_members(m.block) if p is not m and p.name not in m.links]
        count = self.cfg.links if count is None else count
        new = [others[i] for i in torch.randperm(len(others), generator=self.rng)[:count].tolist()]
        for peer in new:
            m.links.add(peer.name)
            peer.links.add(m.name)
        return new

    def relink(self, m: Member, lost: int) -> None:
        """A node that lost standing connections makes as many new ones, as a node keeps its peer
        count up, and the two ends tell each other their versions on them, as on any new connection."""
        for peer in self.link(m, lost):
            for a, b in ((m, peer), (peer, m)):
                self.send(a, b.name, 120, self.heard, a.name, a.replica.state.version, a.replica.synced,
                          not a.replica.synced and self.now < self.stop_at, averaging=False)

    def reachable(self, a: Member, b: Member) -> bool:
        return a.alive and b.alive and (not self.partitioned or a.side == b.side)

    def churn(self) -> None:
        """A fraction of the nodes leaves; as many fresh ones join, each on the leaver's block."""
        live = [m for m in self.members.values() if m.alive]
        leaving = max(1, round(self.cfg.churn * len(live)))
        order = torch.randperm(len(live), generator=self.rng)[:leaving].tolist()
        lost = Counter()
        for i in order:
            gone = live[i]
            gone.alive = False
            for name in gone.links:
                self.members[name].links.discard(gone.name)
                lost[name] += 1
            joiner = self._add(gone.block, genesis=False)
            self.link(joiner)
            self.at(self.cfg.gossip_s, self.join, joiner)
        for name, n in sorted(lost.items()):
            if self.members[name].alive:
                self.relink(self.members[name], n)

    def join(self, m: Member) -> None:
        """What a joiner has heard after gossip: every live same-block member's version; it fetches."""
        for peer in self.block_members(m.block):
            if peer is not m and self.reachable(m, peer):
                m.replica.note_version(peer.name, peer.replica.state.version, peer.replica.synced)
        if not self.maybe_fetch(m):
            self.train(m)

    def split(self, on: bool) -> None:
        self.partitioned = on
        if not on:  # healed: the connections across come back, and versions are exchanged on them
            for m in self.members.values():
                if m.alive:
                    self.announce(m)

    # --- messages ------------------------------------------------------------------------------------

    def send(self, src: Member, dst_name: str, size: int, fn, *args, averaging: bool = True) -> None:
        """A message; `averaging` ones (parts, ranges) count toward the sender's bytes and peers of its round."""
        dst = self.members.get(dst_name)
        if dst is None or not self.reachable(src, dst):
            return
        if averaging:
            sent = src.sent.setdefault(src.replica.round, [0, set()])
            sent[0] += size
            sent[1].add(dst_name)
        else:
            self.other_bytes += size
        src.talked.setdefault(src.replica.round, set()).add(dst_name)
        self.at(self.cfg.latency_s + size * 8 / (self.cfg.mbit * 1e6), fn, dst, *args)

    def data_bytes(self, values: torch.Tensor) -> int:
        """What a message's values weigh on the wire: their share of a block of `block_bytes`."""
        return values.numel() * self.cfg.block_bytes // self.cfg.params

    def train(self, m: Member, share: float = 1.0) -> None:
        """Start a round's local steps: all of them, or the `share` of them left in a holder's round."""
        if not m.alive or self.now >= self.stop_at:
            return
        m.token += 1
        m.trained_at = self.now + m.compute * share
        m.samples = max(1, round(SAMPLES * share))
        self.at(m.compute * share, self.trained, m, m.token)

    def left_in_round(self, m: Member) -> float:
        """The share of its round's local steps a node has still to train (as `state_reply.left`
        tells a fetcher when the state has arrived); 1 if it is not training (it is averaging: a fetcher would be late
        for that round anyway, and trains a whole one)."""
        if m.trained_at is None or m.trained_at <= self.now:
            return 1.0
        return (m.trained_at - self.now) / m.compute

    def trained(self, m: Member, token: int) -> None:
        if not m.alive or m.token != token:
            return
        m.trained_at = None
        m.local += torch.randn(self.cfg.params, generator=self.rng) * 0.01
        for out in m.replica.submit(m.local - m.replica.state.params, m.samples, self.now):
            self.send(m, out.to[0], self.data_bytes(out.message.delta) + 64, self.deliver, out.message)
        if m.name in m.replica.group and m.first_member_round is None:
            m.first_member_round = self.now
        for share in (0.5, 0.75, 1.0):  # (the replica's stages: averaging its rows' parts, its cells, closing)
            self.at(self.cfg.wait_s * share, self.try_close, m)

    def deliver(self, m: Member, message: Part | Reduced) -> None:
        if m.alive:
            m.replica.offer(message, self.now)
            self.try_close(m)

    def try_close(self, m: Member) -> None:
        r = m.replica
        if not m.alive or r.ready_at is None:
            return
        for out in r.due(self.now):
            who = out.message.contributors  # (a bitmap over the group, and the ids of the others)
            size = self.data_bytes(out.message.delta) + 80 + len(who.bits) + 34 * len(who.others)
            message = replace(out.message, sender=m.name)  # (a cell passed on comes from its passer)
            for peer in out.to:
                self.send(m, peer, size, self.deliver, message)
        gone = {p for p in r.group if p not in self.members or not self.members[p].alive}
        if not r.can_close(self.now, gone):
            return
        ready, group = r.ready_at, tuple(r.group)
        closed = r.close()
        self.closes.append({"block": m.block, "round": closed.state.version.round - 1, "node": m.name, "group": group,
                            "waited": self.now - ready, "missing": closed.missing, "at": self.now,
                            "hash": closed.state.version.hash, "contributors": len(closed.contributors)})
        m.local = closed.state.params + (0 if closed.carry is None else closed.carry)
        self.announce(m)
        if not self.maybe_fetch(m):
            self.train(m)

    def announce(self, m: Member) -> None:
        """A node's version to its standing connections and to the peers it averaged with in its last
        round (its row and column); a node that is not a member, to the row it will send its parts
        to. Versions spread from peer to peer: a node that fetches a preferred version announces it
        in turn."""
        version, synced = m.replica.state.version, m.replica.synced
        joining = not synced and self.now < self.stop_at  # (training, not a member)
        row = set(m.replica.row_peers()) if joining else set()  # (to the row it will send its parts to)
        for peer in sorted(m.links | row | (m.sent[max(m.sent)][1] if m.sent else set())):
            self.send(m, peer, 120, self.heard, m.name, version, synced, joining, averaging=False)

    def heard(self, m: Member, sender: str, version: Version, synced: bool, joining: bool) -> None:
        if m.alive:
            m.replica.note_version(sender, version, synced, joining)
            if m.replica.ready_at is None and m.token == 0:
                return  # a joiner still waiting for gossip
            if m.replica.wants(version, in_round=self.now < self.stop_at):  # (else nothing new to fetch)
                self.maybe_fetch(m, in_round=True)

    def maybe_fetch(self, m: Member, in_round: bool = False) -> bool:
        """Fetch the preferred announced state from a live holder (rendezvous-hashed, as a node picks
        its donor, so that joiners spread over the holders), unless one is under way, as a node does;
        whether a fetch started."""
        if m.fetching:
            return False
        best, holders = None, []
        for name, (version, _) in m.replica.announced.items():
            peer = self.members.get(name)
            if (peer is None or not self.reachable(m, peer) or peer.replica.state.version != version
                    or not m.replica.wants(version, in_round=in_round and self.now < self.stop_at)):
                continue
            if best is None or version.preferred_over(best):
                best, holders = version, [peer]
            elif version == best:
                holders.append(peer)
        if not holders:
            return False
        holder = self.members[pick_donor(m.name, [h.name for h in holders])]
        state = holder.replica.state
        size = self.data_bytes(state.params)
        self.send(holder, m.name, size + 34 * len(holder.replica.expected), self.fetched,
                  SharedState(state.version, state.params.clone(), members=tuple(holder.replica.members())),
                  holder, averaging=False)
        self.fetches += 1
        m.fetching = True
        return True

    def fetched(self, m: Member, state: SharedState, holder: Member) -> None:
        m.fetching = False
        if not m.alive or not m.replica.wants(state.version, in_round=self.now < self.stop_at):
            if m.replica.ready_at is None and m.alive:
                self.train(m)  # nothing to adopt after all: back to training
            return
        m.local = m.replica.adopt(state, m.local)
        self.announce(m)
        # (to send its parts with the holder's round, not a round later; the holder's reply follows
        # the state, so it says what is left as the state arrives)
        self.train(m, self.left_in_round(holder) if holder.replica.state.version == state.version else 1.0)

    # --- figures -------------------------------------------------------------------------------------

    def report(self, wall_s: float) -> dict:
        cfg = self.cfg
        same_cells = defaultdict(set)  # (block, round, group, cells missing) -> hashes: one each, or a bug
        rounds = defaultdict(list)  # (block, round) -> its closes while the swarm trains
        for c in self.closes:
            same_cells[c["block"], c["round"], c["group"], c["missing"]].add(c["hash"])
            if c["at"] <= self.stop_at:
                rounds[c["block"], c["round"]].append(c)
        main_group, on_main, members_on_main = [], [], []
        for cs in rounds.values():
            group = Counter(c["group"] for c in cs).most_common(1)[0][0]
            state, n = Counter(c["hash"] for c in cs).most_common(1)[0]
            members = [c for c in cs if c["group"] == group and c["node"] in group]
            main_group.append(group)
            on_main.append(n / len(cs))
            members_on_main.append(sum(c["hash"] == state for c in members) / max(1, len(members)))
        joiners = [m for m in self.members.values() if m.joined > 0]
        caught = [m.first_member_round - m.joined for m in joiners if m.first_member_round is not None]
        # joiners with two rounds' time (and the gossip's) before training stopped: time to be counted in
        in_time = [m for m in joiners if m.joined + cfg.gossip_s + 2 * (cfg.compute_s + cfg.wait_s) <= self.stop_at]
        per_round = [(b, len(peers)) for m in self.members.values() for b, peers in m.sent.values()]
        talked = sorted(len(peers) for m in self.members.values() for peers in m.talked.values())
        finals = {b: len({m.replica.state.version.hash for m in self.block_members(b)}) for b in range(cfg.blocks)}
        waited = [c["waited"] for c in self.closes]
        return {
            "config": cfg.__dict__ | {"partition": list(cfg.partition)},
            "rounds_closed": len(self.closes),
            "closed_by_deadline": sum(w <= cfg.wait_s + 1e-9 for w in waited) / max(1, len(waited)),
            "waited_s_max": max(waited, default=0.0),
            "rounds_with_missing_cells": sum(bool(c["missing"]) for c in self.closes) / max(1, len(self.closes)),
            # replicas that closed a round of one group with the same cells: one state each time
            "same_cells_same_state": sum(len(h) == 1 for h in same_cells.values()) / max(1, len(same_cells)),
            # of the replicas closing a round (while the swarm trains), the share that reached its
            # most common state; of the members of the group most of them laid out, the same; its size
            "closers_on_the_main_state": {"mean": statistics.mean(on_main), "min": min(on_main)},
            "members_on_the_main_state": {"mean": statistics.mean(members_on_main), "min": min(members_on_main)},
            "main_group_size": {"median": statistics.median(len(g) for g in main_group),
                                "min": min(len(g) for g in main_group)},
            "joiners": len(joiners),
            "joiners_became_members": len(caught),
            "joiners_in_time": len(in_time),
            "joiners_in_time_became_members": sum(m.first_member_round is not None for m in in_time),
            "joiner_s_to_first_member_round": {"median": statistics.median(caught) if caught else None,
                                               "max": max(caught, default=None)},
            "bytes_sent_per_node_round": {"mean": statistics.mean(b for b, _ in per_round),
                                          "max": max(b for b, _ in per_round)},
            "block_bytes": cfg.block_bytes,
            "bytes_sent_per_node_round_over_block": {"mean": statistics.mean(b for b, _ in per_round) / cfg.block_bytes,
                                                     "max": max(b for b, _ in per_round) / cfg.block_bytes},
            "state_fetches": self.fetches,
            "version_and_state_bytes_per_node_minute": self.other_bytes / cfg.nodes / (self.now / 60.0),
            "peers_per_node_round": {"mean": statistics.mean(p for _, p in per_round),
                                     "max": max(p for _, p in per_round)},
            # with versions and state transfers: the connections a node uses in a round
            "all_peers_per_node_round": {"mean": statistics.mean(talked), "p99": talked[int(0.99 * len(talked))],
                                         "max": talked[-1]},
            "replicas_per_block": cfg.nodes // cfg.blocks,
            "distinct_states_per_block_at_end": finals,
            "wall_s": wall_s,
        }


def simulate(cfg: Config) -> dict:
    started = time.monotonic()
    swarm = Swarm(cfg)
    step = 30.0
    t = 0.0
    while t < swarm.stop_at + cfg.settle_s:
        t = min(t + step, swarm.stop_at + cfg.settle_s)
        swarm.run(t)
        log.info("simulated %.0f s of %.0f: %d rounds closed, %.0f s wall", t, swarm.stop_at + cfg.settle_s,
                 len(swarm.closes), time.monotonic() - started)
    return swarm.report(time.monotonic() - started)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=Config.nodes)
    parser.add_argument("--blocks", type=int, default=Config.blocks)
    parser.add_argument("--minutes", type=float, default=Config.minutes)
    parser.add_argument("--partition", default="120,180", help="seconds FROM,TO of the partition")
    parser.add_argument("--out", type=Path, default=Path("runs/simulate.json"),
                        help="JSON results (default runs/simulate.json; pass bench/results/simulate.json to "
                             "commit one)")
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    lo, hi = (float(x) for x in a.partition.split(","))
    result = {**provenance(), **simulate(Config(nodes=a.nodes, blocks=a.blocks, minutes=a.minutes,
                                                 partition=(lo, hi)))}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=2))
    print(f"\nJSON: {a.out}")
    return result


if __name__ == "__main__":
    main()
