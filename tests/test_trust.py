"""No one member takes a swarm over by announcing an inflated version (spheroid/averaging/trust.py):
a later round or more samples are taken only when confirmed by a second holder (or by every peer of
the block there); for a state of the round that made a replica's own, when that round could have
made it; for a replica in no group, when a peer of its last round can have got there. Sans I/O with
a fake clock as in test_averaging.py, and once with real nodes and a raw peer."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from dataclasses import replace

import torch

from spheroid.averaging import AveragingConfig, Made, Reduced, Replica, SharedState, Version, confirmed, state_hash

from .nodes import NodeProcess, RawPeer, hello, stop_all, wait_until
from .test_averaging import P, Sim, close_alone, replicas, start_state
from .test_swarm import TINY


def test_a_version_is_confirmed_by_two_holders_or_by_every_peer_heard():
    v, w = Version(5, 100, "a" * 64), Version(10**6, 100, "b" * 64)
    assert confirmed(v, {"p": v, "q": v, "m": w})
    assert not confirmed(w, {"p": v, "q": v, "m": w})  # one holder, whom the others contradict
    assert not confirmed(v, {"p": v, "m": w})  # one against one: neither moves a replica
    assert confirmed(v, {"p": v}) and confirmed(v, {"p": v, "gone": w}, live={"p"})  # no one to confirm it against
    assert not confirmed(v, {}) and not confirmed(v, {"p": v}, live=set())
    assert not confirmed(v, {"p": v}, live={"p", "q"})  # (q is there and has not said: it may not hold it)


def run_round(group: list[Replica], drop=lambda sender, peer, message: False, at: float = 0.0) -> None:
    """One round of `group` starting `at` (each update seeded, 16 samples), every message delivered
    but those `drop(sender, peer, message)` names; then every replica closes."""
    by_name = {r.me: r for r in group}
    gen = torch.Generator().manual_seed(7)
    wave = [(r, out) for r in group for out in r.submit(torch.randn(P, generator=gen) * 0.01, 16, now=at)]
    wait = group[0].cfg.wait
    for now in (at, at + wait / 2, at + 3 * wait / 4, at + wait):
        while wave:
            for r, out in wave:
                message = replace(out.message, sender=r.me)
                for peer in out.to:
                    if not drop(r.me, peer, message):
                        by_name[peer].offer(message)
            wave = [(r, out) for r in group for out in r.due(now)]
    for r in group:
        r.close()


def announce_all(group: list[Replica], synced: bool | None = None) -> None:
    """Every replica of `group` hears every other's version."""
    for r in group:
        for other in group:
            if other is not r:
                r.note_version(other.me, other.state.version, other.synced if synced is None else synced)


def test_a_state_of_the_same_round_from_one_holder_is_checked_against_the_round():
    """a and c miss d's cell, which only b got before d died: b alone holds the preferred state, and
    c (in step with a) contradicts it, so it is not confirmed; but a closed that round, so it knows
    what a state of it can be: its own values (or the base) wherever it got a cell, a plausible change
    in d's cell, no more samples than d's cell could add. b's state is that; states that differ where
    a got a cell, put far-off values in d's cell, or claim far more samples, are not."""
    a, b, c, d = group = replicas(4)
    run_round(group, drop=lambda sender, peer, m: sender == d.me and peer in (a.me, c.me) and isinstance(m, Reduced))
    assert a.state.version == c.state.version and b.state.version == d.state.version
    assert b.state.version.preferred_over(a.state.version)
    announce_all(group)
    live = {a.me, b.me, c.me}  # (d died)
    honest = SharedState(b.state.version, b.state.params.clone())
    mine = a.state.params
    assert a.made is not None and a.made.missed == {(48, 64)}  # (d's cell: the last of four in one row)
    lo, hi = 48, 64
    assert a.choice(live=live) == honest.version and a.trusts(honest.version, live)

    def forged(params: torch.Tensor, samples: int = honest.version.samples, round_: int = 1) -> SharedState:
        return SharedState.create(round_, samples, params, None)

    elsewhere = honest.params.clone()
    elsewhere[3] += 0.01  # a value of a's own cell
    far_off = mine.clone()
    far_off[lo:hi] += 100.0
    for bad, why in ((forged(elsewhere), "a cell this replica received, are another round's"),
                     (forged(far_off), "a cell this replica missed, changed by")):
        assert a.trusts(bad.version, live)  # (plausible by its version: checked once fetched)
        assert why in a.vet(bad, live)
        assert not a.trusts(bad.version, live)  # (and not fetched again)
    richer, later = forged(honest.params, samples=10**6 * honest.version.samples), forged(mine, round_=10**6)
    for lie in (richer, later):
        a.note_version(c.me, lie.version, synced=True)  # (c, say, lies: alone against b)
        assert a.wants(lie.version) and not a.trusts(lie.version, live)
        assert a.choice(live=live) == honest.version
        assert a.vet(lie, live) is not None
    assert a.vet(honest, live) is None
    a.adopt(honest, mine.clone())
    assert a.state.version == b.state.version and a.made is not None  # (it still knows that round)


def test_a_fresh_or_restarted_replica_takes_the_swarms_state_but_not_one_peers_word_against_it():
    swarm = SharedState.create(40, 40 * 48, torch.randn(P), None)
    lie = SharedState.create(10**6, 40 * 48, torch.randn(P), None)
    for start in (start_state(), SharedState.create(12, 12 * 48, torch.randn(P), None)):  # fresh; restarted
        me = Replica("f" * 32, start, AveragingConfig(wait=1.0), synced=start.version.round == 0)
        me.note_version("1" * 32, swarm.version, synced=True)
        assert me.choice() == swarm.version  # (its one peer: no one to confirm it against)
        me.note_version("9" * 32, lie.version, synced=True)
        assert me.choice() is None  # one against one: it waits
        me.note_version("2" * 32, swarm.version, synced=True)
        assert me.choice() == swarm.version and me.vet(swarm) is None and me.vet(lie) is not None


class LiarSim(Sim):
    """A swarm in which one member trains and averages as the others do, but also keeps telling them
    of states of its own making: a round a million ahead, and its round with a million times the
    samples, which it sends when asked."""

    def __init__(self, computes: list[float], wait: float) -> None:
        super().__init__(computes, wait=wait)
        self.liar = self.group[-1]
        self.forged: dict[Version, SharedState] = {}
        self.tempting = 0  # lies heard by a replica that prefers them over its state

    def held(self, name: str, version: Version) -> SharedState | None:
        if name == self.liar.me and version in self.forged:
            return self.forged[version]
        return super().held(name, version)

    def lie(self, every: float) -> None:
        v = self.liar.state.version
        gen = torch.Generator().manual_seed(len(self.forged))
        for lie in (SharedState.create(v.round + 10**6, v.samples, torch.randn(P, generator=gen), None),
                    SharedState.create(v.round, max(1, v.samples) * 10**6, torch.randn(P, generator=gen), None)):
            self.forged[lie.version] = lie
            for r in self.group[:-1]:
                self.at(self.latency, self.announce, r, self.liar, lie.version, True)
        self.at(every, self.lie, every)

    def announce(self, r: Replica, sender: Replica, version: Version, synced: bool, joining: bool = False) -> None:
        if version in self.forged and r.me not in self.dead and r.wants(version):
            self.tempting += 1
        super().announce(r, sender, version, synced, joining)


def test_a_member_announcing_a_round_a_million_ahead_or_a_million_times_the_samples_moves_no_replica():
    """Honest replicas hear the lies every 0.2 s (each one preferred over their state by the version
    rule) and go on averaging with each other, the liar's updates included; one of them killed and
    restarted from its checkpoint catches up to their state, not the liar's."""
    sim = LiarSim([1.0, 1.0, 1.0, 1.0], wait=0.5)
    sim.run(until=3.0)
    sim.lie(every=0.2)
    sim.run(until=5.5)
    victim = sim.group[2]
    saved = SharedState(victim.state.version, victim.state.params.clone())
    sim.dead.add(victim.me)
    sim.run(until=15.0)
    restarted = Replica(victim.me, saved, victim.cfg, synced=False)
    sim.group[2] = restarted
    sim.dead.discard(victim.me)
    sim.local[victim.me] = saved.params.clone()
    sim.train(restarted)
    sim.stop_at = 30.0
    sim.run(until=45.0)
    honest = sim.group[:3]
    assert sim.tempting > 100
    assert not any(r.state.version in sim.forged for r in sim.group)
    assert all(r.counters.adopted == 0 for r in sim.group[:2]) and restarted.counters.adopted >= 1
    assert len({r.state.version for r in sim.group}) == 1 and honest[0].round >= 25
    after = [n for me, _, ready, _, n in sim.closes if ready > 3.0 and me in {r.me for r in sim.group[:2]}]
    assert len(after) >= 2 * 20 and sum(n >= 3 for n in after) > 0.9 * len(after)  # still averaging together


def test_replicas_done_training_follow_the_last_one_still_training_alone_but_no_faster_than_it_can_go():
    """a and b finished training (in no group now), c trains on alone, its rounds faster than theirs
    were (no one to wait for): they follow it round after round, though b contradicts it, since c
    was in their last round and can have got there; not to a round it cannot have reached, nor to
    far more samples than its rounds add, nor while they are in a group."""
    a, b, c = group = replicas(3)
    for t in range(3):  # three rounds together, a second apart
        run_round(group, at=float(t))
    announce_all(group)
    a.synced = b.synced = False  # (done: nodes that finished training say so)
    live = {b.me, c.me}
    now = 3.0
    for _ in range(6):  # c alone: a round every 0.25 s
        c.expected.clear()
        now += 0.25
        close_alone(c, torch.randn(P) * 0.01, now=now)
        a.note_version(c.me, c.state.version, synced=True)
        assert not a._confirmed(c.state.version, live)  # (b still holds the state they finished on)
        assert a.choice(live=live, now=now + 0.1) == c.state.version
        assert a.vet(SharedState(c.state.version, c.state.params.clone()), live, now + 0.1) is None
    v = c.state.version
    for lie in (replace(v, round=v.round + 10**6, hash="a" * 64), replace(v, samples=10**6 * v.samples, hash="c" * 64)):
        a.note_version(c.me, lie, synced=True)
        assert a.wants(lie) and not a.trusts(lie, live, now + 0.1)
    a.note_version(c.me, v, synced=True)
    assert not a.trusts(v, live) and not a.trusts(v, live, now=3.0 - 10.0)  # (no time; or far too soon)
    a.synced = True
    assert not a.trusts(v, live, now + 0.1)  # a member of a group follows no one peer alone


def test_the_round_knowledge_covers_the_outer_momentum_too():
    """With the Nesterov outer step a same-round state's momentum is checked as its parameters are."""
    a, b, c = group = replicas(3, AveragingConfig(wait=1.0, outer="nesterov"))
    run_round(group)
    made: Made = a.made
    assert made is not None and not made.missed and made.samples == a.state.version.samples
    same = SharedState(a.state.version, a.state.params.clone(), a.state.momentum.clone())
    assert made.inconsistency(same, 10.0) is None
    momentum = a.state.momentum.clone()
    momentum[0] += 1.0
    other = SharedState(Version(1, a.state.version.samples, state_hash(a.state.params, momentum)),
                        a.state.params.clone(), momentum)
    assert "momentum" in made.inconsistency(other, 10.0)
    assert "samples" in made.inconsistency(replace(same, version=replace(same.version, samples=made.samples + 1)),
                                           10.0)


def test_nodes_keep_their_state_and_rounds_while_a_peer_announces_inflated_versions(tmp_path, data_dir):
    """Two real nodes of block 0 in step; a raw peer tells each of them of a version a million rounds
    ahead and of one of their round with a million times their samples, again and again: neither
    asks it for its state, and they keep closing rounds together on their own states."""
    flags = ["--block", "0", "--data", str(data_dir), *TINY, "--every", "5", "--wait", "2", "--steps", "100000"]
    a = NodeProcess(tmp_path, "a", *flags, "--out", str(tmp_path / "a-ckpt")).start()
    b = NodeProcess(tmp_path, "b", *flags, "--out", str(tmp_path / "b-ckpt"), "--peer", a.addr).start()
    peers: list[RawPeer] = []
    try:
        def in_step():
            sa, sb = (n.status()["training"] for n in (a, b))
            return sa["round"] >= 2 and sa["version"] == sb["version"] and sa
        start = wait_until(in_step, 120, "two nodes in step")
        me = hello(role="worker", blocks=[0])
        for node in (a, b):
            peer = RawPeer(node.addr, timeout=30)
            peer.send(me)
            peers.append(peer)
        seen: list[str] = []

        def listen(peer: RawPeer) -> None:
            with contextlib.suppress(OSError):  # (closed at the end)
                while True:
                    seen.append(peer.receive()[0]["t"])

        for peer in peers:
            threading.Thread(target=listen, args=(peer,), daemon=True).start()
        ids = itertools.count(2)
        until = time.monotonic() + 8.0
        while time.monotonic() < until:
            v = a.status()["training"]["version"]
            for peer in peers:
                for lie in ({"round": v["round"] + 10**6, "samples": v["samples"], "hash": "ab" * 32},
                            {"round": v["round"], "samples": 10**6 * max(1, v["samples"]), "hash": "cd" * 32}):
                    peer.send({"t": "version", "id": next(ids), "block": 0, **lie, "synced": True})
                peer.send({"t": "ping", "id": next(ids), "ts": time.time()})  # (as a dialler does)
            time.sleep(0.5)
        assert "version" in seen and "state_get" not in seen
        after = wait_until(lambda: (s := in_step()) and s["round"] >= start["round"] + 3 and s, 120,
                           "the nodes to go on in step")
        assert after["version"]["hash"] not in ("ab" * 32, "cd" * 32) and after["counters"]["rejected"] == 0
        history = [h for h in after["history"] if h["round"] > start["round"]]
        assert history and sum(h["updates"] == 2 for h in history) >= len(history) - 1
    finally:
        for peer in peers:
            peer.close()
        stop_all([a, b])
