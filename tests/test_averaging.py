"""The round protocol of spheroid/averaging.py: exact averages, rejections, and a fake-clock swarm."""

from __future__ import annotations

import heapq
import itertools

import pytest
import torch

from spheroid.averaging import AveragingConfig, Replica, SharedState, Update, Version, state_hash

P = 64


def start_state(seed: int = 0, nesterov: bool = False) -> SharedState:
    params = torch.randn(P, generator=torch.Generator().manual_seed(seed))
    return SharedState.create(0, 0, params, torch.zeros(P) if nesterov else None)


def replicas(n: int, cfg: AveragingConfig | None = None) -> list[Replica]:
    cfg = cfg or AveragingConfig(wait=1.0)
    names = [f"{i:032x}" for i in range(n)]
    state = start_state(nesterov=cfg.outer == "nesterov")
    group = [Replica(name, SharedState(state.version, state.params.clone(), state.momentum), cfg) for name in names]
    for r in group:  # they start together from one genesis state and say so
        for other in group:
            if other is not r:
                r.note_version(other.me, other.state.version, synced=True)
    return group


def exchange(group: list[Replica], deltas: list[torch.Tensor], samples: list[int]) -> list[Update]:
    own = [r.submit(d, s, now=0.0) for r, d, s in zip(group, deltas, samples, strict=True)]
    for r in group:
        for u in own:
            if u.sender != r.me:
                assert r.offer(u) == "accepted"
    return own


def test_average_is_exact_when_every_update_arrives():
    group = replicas(3)
    base = group[0].state.params.clone()
    deltas = [torch.randn(P) * 0.01 for _ in group]
    samples = [32, 64, 96]
    exchange(group, deltas, samples)
    closed = [r.close() for r in group]
    expected = base + sum(d * s for d, s in zip(deltas, samples, strict=True)) / sum(samples)
    for c in closed:
        torch.testing.assert_close(c.state.params, expected, rtol=0, atol=1e-6)
        assert c.state.version.round == 1 and c.state.version.samples == 192
        assert sorted(c.contributors) == sorted(r.me for r in group)
    assert len({c.state.version.hash for c in closed}) == 1  # bit-identical on every replica
    assert closed[0].state.version.hash == state_hash(closed[0].state.params)


def test_nesterov_outer_step_matches_its_formula_and_carries_momentum():
    cfg = AveragingConfig(wait=1.0, outer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    group = replicas(2, cfg)
    base = group[0].state.params.clone()
    d1 = [torch.randn(P) * 0.01 for _ in group]
    exchange(group, d1, [10, 10])
    first = [r.close() for r in group]
    avg1 = (d1[0] + d1[1]) / 2
    torch.testing.assert_close(first[0].state.params, base + 0.7 * (avg1 + 0.9 * avg1), rtol=0, atol=1e-6)
    d2 = [torch.randn(P) * 0.01 for _ in group]
    exchange(group, d2, [10, 10])
    second = [r.close() for r in group]
    avg2 = (d2[0] + d2[1]) / 2
    m2 = 0.9 * avg1 + avg2
    torch.testing.assert_close(second[0].state.momentum, m2, rtol=0, atol=1e-6)
    torch.testing.assert_close(second[0].state.params, first[0].state.params + 0.7 * (avg2 + 0.9 * m2),
                               rtol=0, atol=1e-6)
    assert second[0].state.version.hash == second[1].state.version.hash


@pytest.mark.parametrize("bad, reason", [
    (lambda u: setattr(u, "delta", torch.full((P,), float("nan"))), "NaN"),
    (lambda u: setattr(u, "delta", torch.tensor([1.0, float("inf")]).repeat(P // 2)), "NaN or Inf"),
    (lambda u: setattr(u, "delta", torch.zeros(P + 1)), "wrong shape"),
    (lambda u: setattr(u, "delta", torch.zeros(P, dtype=torch.float16)), "wrong shape"),
    (lambda u: setattr(u, "round", 5), "future round"),
    (lambda u: setattr(u, "samples", 0), "no samples"),
])
def test_bad_updates_are_rejected_and_counted(bad, reason):
    me, peer = replicas(2)
    update = Update(peer.me, 0, peer.state.version.hash, 8, torch.zeros(P))
    bad(update)
    assert reason in me.offer(update)
    assert me.counters.rejected == 1 and peer.me not in me.updates


def test_stale_and_late_rounds_are_dropped():
    me, peer = replicas(2)
    for _ in range(2):  # me moves on to round 2 alone
        me.submit(torch.zeros(P), 8, now=0.0)
        me.close()
    assert me.offer(Update(peer.me, 1, "x", 8, torch.zeros(P))) == "late"
    assert me.offer(Update(peer.me, 0, "x", 8, torch.zeros(P))) == "stale round"
    assert me.counters.late == 1 and me.counters.rejected == 1


def test_update_on_another_base_is_never_averaged_in():
    me, peer = replicas(2)
    me.expected = {peer.me}
    assert me.offer(Update(peer.me, 0, "f" * 64, 8, torch.ones(P))) == "held"
    assert peer.me not in me.expected  # and the round does not wait for it
    me.submit(torch.zeros(P), 8, now=0.0)
    assert me.can_close(now=0.0)
    closed = me.close()
    assert closed.contributors == [me.me]
    torch.testing.assert_close(closed.state.params, replicas(1)[0].state.params)


def test_update_with_a_norm_far_outside_its_peers_is_rejected():
    group = replicas(3)
    deltas = [torch.full((P,), 0.01), torch.full((P,), 0.012), torch.full((P,), 5.0)]
    exchange(group, deltas, [8, 8, 8])
    closed = group[0].close()
    assert sorted(closed.contributors) == sorted([group[0].me, group[1].me])
    assert "norm" in closed.rejected[group[2].me]
    torch.testing.assert_close(closed.state.params, replicas(1)[0].state.params + 0.011, rtol=0, atol=1e-6)


def test_version_rule_prefers_later_rounds_then_more_samples_then_smaller_hash():
    assert Version(3, 0, "b").preferred_over(Version(2, 999, "a"))
    assert Version(2, 20, "b").preferred_over(Version(2, 10, "a"))
    assert Version(2, 10, "a").preferred_over(Version(2, 10, "b"))
    assert not Version(2, 10, "a").preferred_over(Version(2, 10, "a"))


def test_adopting_a_state_keeps_local_progress_and_verifies_the_hash():
    me, peer = replicas(2)
    local = me.state.params + 0.5
    peer.submit(torch.full((P,), 0.1), 8, now=0.0)
    newer = peer.close().state
    received = SharedState.unpack(newer.version, newer.flat().clone(), P)
    assert me.wants(received.version)
    rebased = me.adopt(received, local)
    torch.testing.assert_close(rebased, newer.params + 0.5)
    assert me.state.version == newer.version
    # an update already sent is not carried over: the adopted state may hold it already
    me.submit(torch.full((P,), 0.25), 8, now=0.0)
    again = SharedState.create(2, 99, newer.params + 1.0, None)
    torch.testing.assert_close(me.adopt(again, rebased + 0.25), again.params + 0.5)
    with pytest.raises(ValueError, match="does not match"):
        SharedState.unpack(Version(1, 8, "0" * 64), newer.flat(), P)
    with pytest.raises(ValueError, match="float32 values"):
        SharedState.unpack(newer.version, newer.flat()[:-1], P)


# --- a swarm of replicas under a fake clock ---------------------------------------------------------


class Sim:
    """Replicas that 'train' (add a seeded increment) for `compute` seconds a round, linked by a
    network of fixed one-way latency, run by an event queue: no threads, no real time."""

    def __init__(self, computes: list[float], latency: float = 0.05, wait: float = 1.0) -> None:
        self.now = 0.0
        self.queue: list = []
        self.seq = itertools.count()
        self.latency = latency
        self.group = replicas(len(computes), AveragingConfig(wait=wait))
        self.compute = dict(zip([r.me for r in self.group], computes, strict=True))
        self.local = {r.me: r.state.params.clone() for r in self.group}
        self.gen = torch.Generator().manual_seed(1)
        self.dead: set[str] = set()
        self.closes: list[tuple] = []  # (replica, round, ready_at, closed_at, updates averaged)
        self.training: dict[str, int] = {}  # replica -> token of its current training run
        self.stop_at = float("inf")  # no training starts after this; the swarm then settles
        for r in self.group:
            self.train(r)

    def at(self, delay: float, fn, *args) -> None:
        heapq.heappush(self.queue, (self.now + delay, next(self.seq), fn, args))

    def run(self, until: float) -> None:
        while self.queue and self.queue[0][0] <= until:
            self.now, _, fn, args = heapq.heappop(self.queue)
            fn(*args)
        self.now = until

    def train(self, r: Replica) -> None:
        if self.now >= self.stop_at:
            return
        token = self.training[r.me] = self.training.get(r.me, 0) + 1
        self.at(self.compute[r.me], self.trained, r, token)

    def trained(self, r: Replica, token: int) -> None:
        if r.me in self.dead or self.training.get(r.me) != token:
            return
        self.local[r.me] += torch.randn(P, generator=self.gen) * 0.01
        own = r.submit(self.local[r.me] - r.state.params, 16, self.now)
        for peer in self.group:
            if peer is not r:
                self.at(self.latency, self.deliver, peer, own)
        self.at(r.cfg.wait, self.try_close, r)
        self.try_close(r)

    def deliver(self, r: Replica, update: Update) -> None:
        if r.me not in self.dead:
            r.offer(update)
            self.try_close(r)

    def try_close(self, r: Replica) -> None:
        if r.me in self.dead or not r.can_close(self.now):
            return
        ready = r.ready_at
        closed = r.close()
        self.closes.append((r.me, closed.state.version.round - 1, ready, self.now, len(closed.contributors)))
        self.local[r.me] = closed.state.params.clone()
        for peer in self.group:
            if peer is not r:
                self.at(self.latency, self.announce, peer, r, closed.state.version, True)
        self.maybe_fetch(r)
        self.train(r)

    def announce(self, r: Replica, sender: Replica, version: Version, synced: bool) -> None:
        if r.me in self.dead or sender.me in self.dead:
            return
        r.note_version(sender.me, version, synced)
        self.maybe_fetch(r)

    def maybe_fetch(self, r: Replica) -> None:
        """What a node does with the versions it heard: fetch a preferred one from its holder."""
        in_round = self.now < self.stop_at
        for peer in self.group:
            version = r.announced.get(peer.me, (None, None))[0]
            if version and peer.me not in self.dead and peer.state.version == version and r.wants(version, in_round):
                self.at(2 * self.latency, self.fetched, r, SharedState(version, peer.state.params.clone()))
                return

    def fetched(self, r: Replica, state: SharedState) -> None:
        if r.me in self.dead or not r.wants(state.version, in_round=self.now < self.stop_at):
            return
        was_waiting = r.ready_at is not None
        self.local[r.me] = r.adopt(state, self.local[r.me])
        for peer in self.group:
            if peer is not r:
                self.at(self.latency, self.announce, peer, r, state.version, False)
        if was_waiting:  # its round was dropped with the old base: back to training
            self.train(r)

    def hashes(self) -> set[str]:
        return {r.state.version.hash for r in self.group if r.me not in self.dead}


def test_fake_clock_rounds_agree_when_all_are_in_time():
    sim = Sim([1.0, 1.1, 1.2], wait=1.0)
    sim.stop_at = 30.0
    sim.run(until=40.0)
    assert min(r.round for r in sim.group) >= 10
    assert len(sim.hashes()) == 1
    assert all(r.counters.adopted == 0 and r.counters.late == 0 for r in sim.group)
    for _, _, ready, closed, _ in sim.closes:
        assert closed - ready <= 1.0 + 1e-9


def test_fake_clock_slow_peer_misses_the_deadline_and_others_keep_time():
    sim = Sim([1.0, 1.0, 5.0], wait=0.5)
    sim.run(until=40.0)
    fast = {r.me for r in sim.group[:2]}
    fast_closes = [(ready, closed, n) for me, _, ready, closed, n in sim.closes if me in fast]
    assert len(fast_closes) >= 2 * 15  # they went on without waiting for the slow one
    assert all(closed - ready <= 0.5 + 1e-9 for ready, closed, _ in fast_closes)
    assert sum(n < 3 for _, _, n in fast_closes) > len(fast_closes) / 2  # mostly without it
    sim.stop_at = 40.0
    sim.run(until=60.0)
    assert len(sim.hashes()) == 1  # settled on one state, the slow peer's work included or not


def test_fake_clock_killed_replica_catches_up_and_matches_after_the_next_round():
    sim = Sim([1.0, 1.0, 1.0], wait=0.5)
    sim.run(until=5.5)
    victim = sim.group[2]
    saved = SharedState(victim.state.version, victim.state.params.clone())  # its last checkpoint
    sim.dead.add(victim.me)
    sim.run(until=15.0)
    survivors = sim.group[:2]
    assert min(r.round for r in survivors) >= saved.version.round + 5  # nobody waited past deadlines
    # restart from the checkpoint
    restarted = Replica(victim.me, saved, victim.cfg)
    sim.group[2] = restarted
    sim.dead.discard(victim.me)
    sim.local[victim.me] = saved.params.clone()
    sim.train(restarted)
    sim.run(until=18.0)  # its first round's versions make it adopt the survivors' state
    assert restarted.counters.adopted >= 1
    assert restarted.round >= survivors[0].round - 1
    sim.stop_at = 30.0
    sim.run(until=45.0)
    assert len(sim.hashes()) == 1
    assert restarted.round == survivors[0].round


def test_fake_clock_joiner_syncs_and_nobody_waits_for_it():
    sim = Sim([1.0, 1.0, 1.0], wait=2.0)
    joiner = sim.group[2]
    sim.dead.add(joiner.me)  # not started yet; the others begin in step without it
    for r in sim.group[:2]:
        r.expected.discard(joiner.me)
    sim.run(until=6.2)
    sim.dead.discard(joiner.me)
    sim.train(joiner)
    donor = sim.group[0]
    sim.announce(joiner, donor, donor.state.version, True)  # what it hears on connecting
    sim.run(until=12.0)
    assert joiner.counters.adopted >= 1
    # rounds the others closed after it joined: never held to the deadline by the joiner
    for me, _, ready, closed, _ in sim.closes:
        if me != joiner.me and ready > 6.2:
            assert closed - ready < 1.0
    sim.stop_at = 12.0
    sim.run(until=30.0)
    assert len(sim.hashes()) == 1
