"""The round protocol of spheroid/averaging.py: a butterfly all-reduce with exact averages, rejections,
missing ranges, and a fake-clock swarm."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
from dataclasses import replace

import pytest
import torch

from spheroid import averaging
from spheroid.averaging import (
    CHECKED_LEAVES,
    DIGEST,
    LEAF,
    AveragingConfig,
    Contributors,
    Layout,
    Part,
    Reduced,
    Replica,
    SharedState,
    Version,
    group_digest,
    leaf_digests,
    leaf_range,
    state_hash,
)
from spheroid.wire import through_codec

P = 64
PL = 256  # values of a block in tests of two levels (each of a group's cells has some)


def start_state(seed: int = 0, nesterov: bool = False, p: int = P) -> SharedState:
    params = torch.randn(p, generator=torch.Generator().manual_seed(seed))
    return SharedState.create(0, 0, params, torch.zeros(p) if nesterov else None)


def replicas(n: int, cfg: AveragingConfig | None = None, wire=None, p: int = P) -> list[Replica]:
    cfg = cfg or AveragingConfig(wait=1.0)
    names = [f"{i:032x}" for i in range(n)]
    state = start_state(nesterov=cfg.outer == "nesterov", p=p)
    extra = {"wire": wire} if wire else {}
    group = [Replica(name, SharedState(state.version, state.params.clone(), state.momentum), cfg, **extra)
             for name in names]
    for r in group:  # they start together from one genesis state and say so
        for other in group:
            if other is not r:
                r.note_version(other.me, other.state.version, synced=True)
    return group


def exchange(group: list[Replica], deltas: list[torch.Tensor], samples: list[int], wire=lambda t: t,
             sent: dict[str, list] | None = None, dead: frozenset[str] = frozenset()) -> None:
    """One round: every message delivered, wave after wave (parts, then what is due, until nothing
    is), except to and from the `dead`, whose absence the others wait out stage by stage. `sent`
    collects, per sender, the values sent and the peers sent to."""
    by_name = {r.me: r for r in group}
    live = [r for r in group if r.me not in dead]
    wave = [(r, out) for r, d, s in zip(group, deltas, samples, strict=True) if r.me not in dead
            for out in r.submit(d, s, now=0.0)]
    wait = group[0].cfg.wait
    for now in (0.0, wait / 2, 3 * wait / 4, wait):  # (the stages' times, in one or two levels)
        while wave:
            for r, out in wave:
                message = replace(out.message, sender=r.me, delta=wire(out.message.delta))
                for peer in out.to:
                    if peer not in dead:
                        assert by_name[peer].offer(message) == "accepted"
                    if sent is not None:
                        sent.setdefault(r.me, [0, set()])[0] += message.delta.numel()
                        sent[r.me][1].add(peer)
            wave = [(r, out) for r in live for out in r.due(now)]
        if not dead:
            return
        wave = [(r, out) for r in live for out in r.due(now)]


def flat_range(group: list[str], name: str) -> tuple[int, int]:
    """A member's range in a group of one row."""
    members = sorted(group)
    return Layout.of(members, P, flat=16).columns[members.index(name)]


def test_ranges_tile_the_vector_and_every_replica_computes_the_same_ones():
    group = [f"{i:032x}" for i in (3, 1, 2)]
    layout = Layout.of(group, 10, flat=16)
    assert layout.rows == (tuple(sorted(group)),) and layout.columns == ((0, 4), (4, 7), (7, 10))
    assert Layout.of(list(reversed(group)), 10, flat=16) == layout


def test_a_large_group_is_laid_out_in_rows_whose_cells_tile_the_vector():
    group = [f"{i:032x}" for i in range(23)]
    layout = Layout.of(group, 1000, flat=16)
    assert [len(row) for row in layout.rows] == [6, 6, 6, 5] and len(layout.columns) == 5
    bounds = [cell for _, _, cell in layout.all_cells()]
    assert bounds[0][0] == 0 and bounds[-1][1] == 1000 and all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    long = layout.rows[0]
    assert layout.owned(long[1]) == [1] and layout.owned(long[5]) == []  # a longer row's last owns none
    assert layout.owned("f" * 32) == [] and 0 <= layout.row_of("f" * 32) < 4  # a joiner owns nothing
    assert Layout.of(group, 1000, flat=23).rows == (tuple(group),)
    assert Layout.of(group, 80, flat=16).rows == (tuple(group),)  # a block too small for cells of every row


def test_average_is_exact_when_every_range_arrives():
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
        assert not c.missing and c.carry is None
    assert len({c.state.version.hash for c in closed}) == 1  # bit-identical on every replica
    assert closed[0].state.version.hash == state_hash(closed[0].state.params)


def test_replicas_hold_what_their_peers_decode_through_a_lossy_codec():
    """Each range is averaged once, by its owner, and everyone (the owner too) uses it as decoded."""
    wire = lambda t: t.to(torch.bfloat16).to(torch.float32)  # noqa: E731 (a lossy round trip)
    group = replicas(4, wire=wire)
    exchange(group, [torch.randn(P) * 0.01 for _ in group], [8, 8, 8, 8], wire=wire)
    assert len({r.close().state.version.hash for r in group}) == 1


PH = 30 * LEAF + 1000  # values of a block in tests of the state hash's leaves (each cell holds whole leaves)


@pytest.mark.parametrize("n, flat, outer", [(3, 16, "average"), (4, 16, "nesterov"), (12, 4, "average"),
                                            (12, 4, "nesterov")])
def test_the_state_hash_is_built_from_the_leaf_digests_the_owners_send(n, flat, outer):
    """Each replica hashes about 2 / n of the state, yet its hash is the whole state's."""
    wire = lambda t: t.to(torch.bfloat16).to(torch.float32)  # noqa: E731 (a lossy codec: decoded twice in two levels)
    group = replicas(n, AveragingConfig(wait=1.0, flat=flat, outer=outer, codec="bf16"), wire=wire, p=PH)
    exchange(group, [torch.randn(PH) * 0.01 for _ in group], [8] * n, wire=wire)
    assert all(leaf_range(*cell, PH) for cell in group[0].reduced)  # (every cell holds leaves...
    assert all(r.reduced[cell].leaves for r in group for cell in r.reduced)  # ... and came with their digests
    closed = [r.close() for r in group]
    assert len({c.state.version.hash for c in closed}) == 1
    state = closed[0].state
    assert state.version.hash == state_hash(state.params, state.momentum)
    assert not any(r.counters.rejected or r.counters.forged for r in group)


@pytest.mark.parametrize("forge", ["cell", "leaf"])
def test_forged_leaf_digests_are_caught_by_the_replicas_whose_sample_falls_on_them(forge, monkeypatch):
    """An owner sends its cell's average right, with digests of other values: of every leaf, or of
    one. A replica whose random sample of received leaves falls on a forged digest hashes the cell
    itself; one whose sample misses it takes the forged digests (and its hash is then not that of
    its values)."""
    n = 8
    group = replicas(n, p=PH)
    forger = group[1]
    finish = forger._finish_cell

    def forged(mine):
        finish(mine)
        mine.leaves = bytes(len(mine.leaves)) if forge == "cell" else bytes(DIGEST) + mine.leaves[DIGEST:]

    forger._finish_cell = forged
    for seed, r in enumerate(group):
        r.rng = random.Random(4 + seed)
    exchange(group, [torch.randn(PH) * 0.01 for _ in group], [8] * n)
    hashed, closed, columns = [], {}, group[0].layout.columns

    def counted(values, leaves):
        hashed[-1] += len(leaves)
        return leaf_digests(values, leaves)

    monkeypatch.setattr(averaging.state, "leaf_digests", counted)  # (where the close looks it up)
    for r in group:
        hashed.append(0)
        closed[r.me] = r.close()
    monkeypatch.undo()
    assert len({c.state.params.sum().item() for c in closed.values()}) == 1  # the same values everywhere
    true = state_hash(closed[forger.me].state.params)
    caught = [r.me for r in group if r.counters.forged]
    # (these seeds: some replicas' samples fell on the forged digests, some did not)
    assert 0 < len(caught) < n - 1 and forger.me not in caught
    for r in group:
        assert (closed[r.me].state.version.hash == true) == (r is forger or r.me in caught)
    # a replica hashes its own cell's leaves (in `_finish_cell`, not here), the leaves across
    # cells and CHECKED_LEAVES of the others', and one that caught a forgery the whole forged cell
    cell_leaves = len(leaf_range(*columns[1], PH))
    across = -(-PH // LEAF) - sum(len(leaf_range(lo, hi, PH)) for lo, hi in columns)
    for r, count in zip(group, hashed, strict=True):
        assert count == across + CHECKED_LEAVES + (cell_leaves if r.me in caught else 0)


def test_a_cell_without_its_leaf_digests_is_refused():
    group = replicas(2, p=PH)
    parts = [out for r in group for out in r.submit(torch.randn(PH) * 0.01, 8, now=0.0)]
    for out in parts:
        assert group[int(out.to[0], 16)].offer(replace(out.message)) == "accepted"
    cell = next(out.message for out in group[0].due(0.0))
    refused = "leaf digests missing, or not one for each leaf within the cell"
    assert group[1].offer(replace(cell, leaves=None)) == refused
    assert group[1].offer(replace(cell, leaves=cell.leaves[:-DIGEST])) == refused
    assert group[1].offer(cell) == "accepted"
    small = replicas(2)  # cells without a whole leaf: their digests are empty, not absent
    parts = [out for r in small for out in r.submit(torch.randn(P) * 0.01, 8, now=0.0)]
    for out in parts:
        assert small[int(out.to[0], 16)].offer(out.message) == "accepted"
    cell = next(out.message for out in small[0].due(0.0))
    assert cell.leaves == b"" and small[1].offer(replace(cell, leaves=None)) == refused
    assert small[1].offer(cell) == "accepted"
    assert small[0].offer(next(out.message for out in small[1].due(0.0))) == "accepted"
    closed = [r.close().state for r in small]
    assert closed[0].version.hash == closed[1].version.hash == state_hash(closed[0].params)


@pytest.mark.parametrize("n, flat, feedback", [(3, 16, False), (3, 16, True), (12, 4, True)])
def test_error_feedback_sends_what_rounding_lost_in_later_rounds(n, flat, feedback):
    """int4 zeroes every value under 1/14 of its block's largest: without error feedback such small
    steady progress never reaches the shared state; with it, the rounding error stays within one
    round's while replicas still agree bit for bit, in one level or two (where the rows' averages
    of each cell are rounded too)."""
    wire = lambda t: through_codec(t, "int4")  # noqa: E731
    group = replicas(n, AveragingConfig(wait=1.0, codec="int4", feedback=feedback, flat=flat), wire=wire, p=PL)
    base = group[0].state.params.clone()
    steps = [torch.full((PL,), 0.001 * (i % 3 + 1)) for i in range(n)]
    for step in steps:
        step[::16] = 0.1  # one large value per 16: the block's scale
    carries = [torch.zeros(PL) for _ in group]
    rounds = 20
    for _ in range(rounds):
        exchange(group, [s + c for s, c in zip(steps, carries, strict=True)], [8] * n, wire=wire)
        assert group[0].layout.two_level == (n > flat)
        closed = [r.close() for r in group]
        assert len({c.state.version.hash for c in closed}) == 1
        carries = [c.carry if c.carry is not None else torch.zeros(PL) for c in closed]
    drift = (group[0].state.params - (base + rounds * sum(steps) / n)).abs().max()
    if feedback:
        assert drift < 0.1 / 7  # (at most about one round's rounding)
    else:
        assert drift > 0.9 * 0.002 * rounds  # the values averaging 0.002 a round never moved


def test_a_round_starts_at_a_members_first_message_but_no_more_than_half_the_deadline_early():
    me, peer = replicas(2, AveragingConfig(wait=10.0))
    stranger = "ee" * 16
    me.offer(Part(stranger, 0, me.state.version.hash, 8, 0, P, torch.zeros(P), age=1e9), now=1.0)  # held
    me.offer(Part(peer.me, 0, me.state.version.hash, 8, *flat_range([me.me, peer.me], me.me),
                  torch.zeros(32), age=2.0), now=3.0)  # held until submit, then accepted
    me.submit(torch.zeros(P), 8, now=4.0)
    assert me.start == 1.0  # the peer's round started at 3 - 2; the stranger's claim counts for nothing
    late = replicas(2, AveragingConfig(wait=10.0))[0]
    late.submit(torch.zeros(P), 8, now=20.0)
    late.offer(Reduced(peer.me, 0, late.state.version.hash, *flat_range([late.me, peer.me], peer.me),
                       Contributors.of(late.group, [peer.me]), 8, torch.zeros(32), age=10.0, leaves=b""), now=20.5)
    assert late.start == 15.0  # half of wait before its own update, not 10.5


def test_a_peer_can_have_only_a_few_messages_held():
    me, _ = replicas(2)
    stranger = "ee" * 16
    answers = [me.offer(Part(stranger, 1, "x", 8, lo, lo + 1, torch.zeros(1)), now=0.0) for lo in range(10)]
    assert answers.count("held") == 4 and answers[-1] == "too many held"


def test_a_large_group_averages_exactly_in_two_levels_and_agrees_bit_for_bit():
    group = replicas(20, AveragingConfig(wait=1.0, flat=4), p=PL)  # 4 rows of 5
    base = group[0].state.params.clone()
    deltas = [torch.randn(PL) * 0.01 for _ in group]
    samples = [8 * (i + 1) for i in range(len(group))]
    exchange(group, deltas, samples)
    assert group[0].layout.two_level
    closed = [r.close() for r in group]
    expected = base + sum(d * s for d, s in zip(deltas, samples, strict=True)) / sum(samples)
    for c in closed:
        torch.testing.assert_close(c.state.params, expected, rtol=0, atol=1e-6)
        assert c.state.version.samples == sum(samples) and not c.missing and c.carry is None
        assert c.contributors == sorted(r.me for r in group)
    assert len({c.state.version.hash for c in closed}) == 1
    assert not any(r.counters.capped for r in group)  # (honest rows' totals differ, within the ratio)


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "bf16"])
def test_two_levels_through_a_lossy_codec_agree_bit_for_bit_with_error_feedback(codec):
    """A column owner passes a cell on as it decoded it; every replica uses the cell decoded once more."""
    wire = (lambda t: through_codec(t, codec)) if codec != "bf16" else (lambda t: t.to(torch.bfloat16).float())
    cfg = AveragingConfig(wait=1.0, flat=4, codec=codec, feedback=True)
    group = replicas(14, cfg, wire=wire, p=PL)  # rows of 5, 5, 4: the longer rows' last members own no column
    for _ in range(3):
        exchange(group, [torch.randn(PL) * 0.01 for _ in group], [8] * len(group), wire=wire)
        closed = [r.close() for r in group]
        assert len({c.state.version.hash for c in closed}) == 1 and all(not c.missing for c in closed)


def test_a_dead_member_of_a_large_group_costs_one_cell_and_its_row_stays_in_step():
    """Its cell is missing everywhere, and its row's parts of its column are carried over; the cells
    it would have passed on to its row come from their owners, so every live replica ends alike."""
    group = replicas(16, AveragingConfig(wait=1.0, flat=4), p=PL)  # 4 rows of 4
    dead = group[5]  # row 1, column 1
    layout = Layout.of([r.me for r in group], PL, flat=4)
    row = set(layout.rows[1]) - {dead.me}
    deltas = [torch.randn(PL) * 0.01 for _ in group]
    exchange(group, deltas, [8] * 16, dead=frozenset({dead.me}))
    assert all(r.can_close(now=1.0) for r in group if r is not dead)
    closed = {r.me: r.close() for r in group if r is not dead}
    assert len({c.state.version for c in closed.values()}) == 1
    assert all(c.missing == (layout.cells[1][1],) for c in closed.values())
    everyone = closed[group[0].me]
    assert everyone.contributors == sorted({r.me for r in group} - {dead.me})  # in half the values, at least
    # samples per value: 15 x 8 in three columns (192 values), 12 x 8 in the dead one's column's three other cells
    assert everyone.state.version.samples == (120 * 192 + 96 * 48) // PL
    lo, hi = layout.columns[1]
    for name in row:  # their parts of the dead one's column were averaged nowhere: carried over
        me = next(i for i, r in enumerate(group) if r.me == name)
        torch.testing.assert_close(closed[name].carry[lo:hi], deltas[me][lo:hi])
        assert not closed[name].carry[:lo].any() and not closed[name].carry[hi:].any()


def test_a_joiner_in_a_large_group_sends_to_one_row_and_receives_every_cell():
    group = replicas(17, AveragingConfig(wait=1.0, flat=4), p=PL)
    joiner = group[-1]
    for r in group[:-1]:  # it fetched their state: announced, not synced, and not one of theirs
        r.expected.discard(joiner.me)
        r.note_version(joiner.me, r.state.version, synced=False)
    joiner.synced, joiner.expected = False, {r.me for r in group[:-1]}
    sent: dict[str, list] = {}
    exchange(group, [torch.randn(PL) * 0.01 for _ in group], [8] * 17, sent=sent)
    assert joiner.me not in joiner.group and joiner.layout == group[0].layout
    assert sent[joiner.me][1] == set(group[0].layout.rows[joiner.row])  # its parts: to its row's owners
    closed = [r.close() for r in group]
    assert len({c.state.version.hash for c in closed}) == 1 and not closed[0].missing
    assert joiner.me in closed[0].contributors and closed[-1].carry is None
    assert group[0].submit(torch.zeros(PL), 8, now=2.0) and joiner.me in group[0].group  # a member next round


@pytest.mark.parametrize("n", [17, 64, 250])
def test_in_two_levels_a_node_sends_about_two_vectors_to_about_two_sqrt_n_peers(n):
    p = 1 << 16
    group = replicas(n, AveragingConfig(wait=1.0), p=p)
    sent: dict[str, list] = {}
    exchange(group, [torch.zeros(p) for _ in group], [8] * n, sent=sent)
    layout = group[0].layout
    assert len(layout.rows) == math.isqrt(n)
    for values, peers in sent.values():
        assert values <= 2 * p * (1 + 1 / len(layout.columns)) and len(peers) <= 2 * math.isqrt(n) + 2
    if n == 250:
        assert max(values for values, _ in sent.values()) <= 2.2 * p
    assert len({r.close().state.version.hash for r in group}) == 1


def test_int2_averaging_needs_error_feedback():
    with pytest.raises(ValueError, match="error feedback"):
        AveragingConfig(codec="int2")
    assert AveragingConfig(codec="int2", feedback=True).lossy


def test_a_replicas_partners_are_its_row_and_its_column_this_round_and_the_next():
    group = replicas(64, AveragingConfig(wait=1.0), p=1 << 16)
    me = group[9]
    layout = Layout.of([r.me for r in group], 1 << 16, flat=16)
    r, (c,) = layout.row_of(me.me), layout.owned(me.me)
    column = {layout.owner(row, c) for row in range(len(layout.rows))}
    assert me.partners() == (set(layout.rows[r]) | column) - {me.me}  # before submit: the next round's
    me.submit(torch.zeros(1 << 16), 8, now=0.0)
    assert me.partners() == (set(layout.rows[r]) | column) - {me.me} and len(me.partners()) <= 2 * 8


def test_a_node_sends_two_vectors_per_round_whatever_the_number_of_replicas():
    for n in (2, 4, 8):
        group = replicas(n)
        by_name = {r.me: r for r in group}
        sent = {r.me: 0 for r in group}
        for r, parts in [(r, r.submit(torch.randn(P), 8, now=0.0)) for r in group]:
            for out in parts:
                sent[r.me] += out.message.delta.numel()
                assert by_name[out.to[0]].offer(out.message) == "accepted"
        for r in group:
            [out] = r.due(now=0.0)
            sent[r.me] += out.message.delta.numel() * len(out.to)
        assert all(total == 2 * (n - 1) * P // n for total in sent.values())


def test_members_send_to_the_peers_after_them_first_as_a_ring_does():
    """Each member sends its parts, then its cell, starting with the member after it: the k-th sends
    of all members go to k different peers, not all to the same one (whose reads would pace them)."""
    group = replicas(8)
    by_name = {r.me: r for r in group}
    names = sorted(by_name)
    sends = {r.me: r.submit(torch.randn(P), 8, now=0.0) for r in group}
    for me, parts in sends.items():
        i = names.index(me)
        assert [o.to[0] for o in parts] == [names[(i + k) % 8] for k in range(1, 8)]
        for out in parts:
            by_name[out.to[0]].offer(out.message)
    for k in range(7):
        assert len({parts[k].to[0] for parts in sends.values()}) == 8
    for r in group:
        [out] = r.due(now=0.0)
        i = names.index(r.me)
        assert list(out.to) == [names[(i + k) % 8] for k in range(1, 8)]


def test_a_missing_range_is_not_averaged_and_each_replica_carries_its_own_part():
    group = replicas(3)
    base = group[0].state.params.clone()
    deltas = [torch.randn(P) * 0.01 for _ in group]
    by_name = {r.me: r for r in group}
    dead = group[2]
    sent = [r.submit(d, 8, now=0.0) for r, d in zip(group[:2], deltas, strict=False)]
    for parts in sent:
        for out in parts:
            if out.to[0] != dead.me:
                by_name[out.to[0]].offer(out.message)
    live = group[:2]
    assert not live[0].due(now=0.4) and live[0].deadline() == 0.5
    for r in live:
        [out] = r.due(now=0.5)  # half the deadline: averaged without the dead one's part
        for peer in out.to:
            if peer != dead.me:
                by_name[peer].offer(out.message)
    assert not live[0].can_close(now=0.9) and live[0].can_close(now=1.0)
    assert live[0].can_close(now=0.0, gone={dead.me})  # a peer known gone is not waited for
    closed = [r.close() for r in live]
    lo, hi = flat_range([r.me for r in group], dead.me)
    assert closed[0].state.version.hash == closed[1].state.version.hash
    # samples count per value averaged: the two thirds of the vector averaged from 8 + 8
    assert closed[0].missing == ((lo, hi),) and closed[0].state.version.samples == 16 * (P - (hi - lo)) // P
    torch.testing.assert_close(closed[0].state.params[lo:hi], base[lo:hi])  # not averaged there
    torch.testing.assert_close(closed[0].state.params[:lo], base[:lo] + (deltas[0][:lo] + deltas[1][:lo]) / 2)
    for c, d in zip(closed, deltas, strict=False):  # each keeps its own work there, to send next round
        torch.testing.assert_close(c.carry[lo:hi], d[lo:hi])
        assert not c.carry[:lo].any() and not c.carry[hi:].any()
    assert sorted(closed[0].contributors) == sorted(r.me for r in live)
    assert dead.me not in live[0].expected  # the next round's group is the two of them


def test_a_joiner_owns_no_range_until_it_has_contributed():
    a, b, joiner = replicas(3)
    for r in (a, b):  # the joiner fetched their state: announced, not synced, and not one of theirs
        r.expected.discard(joiner.me)
        r.note_version(joiner.me, r.state.version, synced=False)
    joiner.synced = False
    joiner.expected = {a.me, b.me}
    exchange([a, b, joiner], [torch.full((P,), 0.1), torch.full((P,), 0.2), torch.full((P,), 0.3)], [8, 8, 8])
    assert joiner.me not in joiner.group and a.group == b.group == joiner.group == sorted([a.me, b.me])
    closed = [r.close() for r in (a, b, joiner)]
    assert len({c.state.version.hash for c in closed}) == 1 and closed[0].state.version.samples == 24
    a.submit(torch.zeros(P), 8, now=1.0)
    joiner.submit(torch.zeros(P), 8, now=1.0)
    assert joiner.me in a.group and joiner.me in joiner.group  # a member now, on both sides


def test_row_owners_wait_for_an_announced_joiner_until_the_row_stage_and_no_longer():
    """Without this a joiner's part counted only if it beat the row's last member, and joiners took
    many rounds to become members (bench/simulate.py)."""
    def setup() -> tuple[Replica, Replica, Replica]:
        a, b, joiner = replicas(3, AveragingConfig(wait=1.0))
        for r in (a, b):  # the joiner fetched their state and announced it to its row
            r.expected.discard(joiner.me)
            r.note_version(joiner.me, r.state.version, synced=False, joining=True)
        joiner.synced, joiner.expected = False, {a.me, b.me}
        return a, b, joiner

    def deliver(by: dict[str, Replica], sender: Replica, outs: list, now: float) -> None:
        for out in outs:
            for peer in out.to:
                assert by[peer].offer(replace(out.message, sender=sender.me), now) == "accepted"

    a, b, joiner = setup()
    by = {r.me: r for r in (a, b, joiner)}
    assert joiner.row_peers() == sorted([a.me, b.me])  # whom it announces to
    outs = [(r, r.submit(torch.full((P,), value), 8, now=0.0)) for r, value in ((a, 0.1), (b, 0.2))]
    for r, out in outs:
        deliver(by, r, out, 0.0)
    assert a.due(0.1) == [] and b.due(0.1) == []  # every member's part is in, the joiner's is awaited
    deliver(by, joiner, joiner.submit(torch.full((P,), 0.3), 8, now=0.2), 0.2)
    for r in (a, b):
        deliver(by, r, r.due(0.2), 0.2)
    closed = [r.close() for r in (a, b, joiner)]
    assert len({c.state.version.hash for c in closed}) == 1 and closed[0].state.version.samples == 24
    assert a.submit(torch.zeros(P), 8, now=1.0) and joiner.me in a.group  # a member from the next round

    a, b, joiner = setup()  # a joiner that does not come: waited for until the row stage only
    by = {r.me: r for r in (a, b, joiner)}
    outs = [(r, r.submit(torch.full((P,), value), 8, now=0.0)) for r, value in ((a, 0.1), (b, 0.2))]
    for r, out in outs:
        deliver(by, r, out, 0.0)
    assert a.due(0.45) == [] and a.due(0.5)

    a, b, done = setup()  # a node that finished training says so: nobody waits for it
    for r in (a, b):
        r.note_version(done.me, r.state.version, synced=False, joining=False)
    by = {r.me: r for r in (a, b, done)}
    outs = [(r, r.submit(torch.full((P,), value), 8, now=0.0)) for r, value in ((a, 0.1), (b, 0.2))]
    for r, out in outs:
        deliver(by, r, out, 0.0)
    assert a.due(0.0) and b.due(0.0)


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


def close_alone(r: Replica, delta: torch.Tensor, now: float = 0.0):
    """A round in which nothing from the peers arrives: it closes at the deadline."""
    r.submit(delta, 8, now)
    r.due(now + r.cfg.wait / 2)
    return r.close()


@pytest.mark.parametrize("bad, reason", [
    (lambda u: setattr(u, "delta", torch.full((u.hi - u.lo,), float("nan"))), "NaN"),
    (lambda u: setattr(u, "delta", torch.tensor([1.0, float("inf")]).repeat((u.hi - u.lo) // 2)), "NaN, Inf"),
    (lambda u: setattr(u, "delta", torch.zeros(u.hi - u.lo + 1)), "wrong shape"),
    (lambda u: setattr(u, "delta", torch.zeros(u.hi - u.lo, dtype=torch.float16)), "wrong shape"),
    (lambda u: setattr(u, "round", 5), "future round"),
    (lambda u: setattr(u, "samples", 0), "no samples"),
    (lambda u: (setattr(u, "hi", P + 8), setattr(u, "delta", torch.zeros(P + 8 - u.lo))), "outside"),
    (lambda u: (setattr(u, "lo", u.lo + 1), setattr(u, "delta", torch.zeros(u.hi - u.lo))), "another partition"),
])
@pytest.mark.parametrize("kind", ["part", "reduced"])
def test_bad_parts_and_ranges_are_refused_and_counted(bad, reason, kind):
    me, peer = replicas(2)
    me.submit(torch.zeros(P), 8, now=0.0)
    lo, hi = flat_range(me.group, me.me if kind == "part" else peer.me)
    base = peer.state.version.hash
    message = (Part(peer.me, 0, base, 8, lo, hi, torch.zeros(hi - lo)) if kind == "part" else
               Reduced(peer.me, 0, base, lo, hi, Contributors.of(me.group, [me.me, peer.me]), 16, torch.zeros(hi - lo),
                       leaves=b""))
    bad(message)
    assert reason in me.offer(message)
    assert me.counters.rejected == 1 and peer.me not in me.parts and peer.me not in me.reduced


def test_a_cell_is_lent_into_the_next_state_once_and_only_to_its_owner():
    """`place` gives the memory of a cell's values in the next state to the frame bringing that cell
    from its owner, once a round; anything else gets memory of its own."""
    me, peer, third = replicas(3)
    lo, hi = flat_range([me.me, peer.me, third.me], peer.me)
    base = me.state.version.hash
    assert me.place(peer.me, 0, base, lo, hi) is None  # before submit: no next state yet
    me.submit(torch.zeros(P), 8, now=0.0)
    assert me.place(third.me, 0, base, lo, hi) is None  # not the cell's owner
    assert me.place(peer.me, 1, base, lo, hi) is None and me.place(peer.me, 0, "other", lo, hi) is None
    assert me.place(peer.me, 0, base, lo, hi - 1) is None  # not a cell
    assert me.place(me.me, 0, base, *flat_range(me.group, me.me)) is None  # its own: averaged here
    into = me.place(peer.me, 0, base, lo, hi)
    assert into.data_ptr() == me.next_params[lo:].data_ptr() and into.numel() == hi - lo
    assert me.place(peer.me, 0, base, lo, hi) is None  # lent once


def test_in_two_levels_no_cell_is_lent():
    """A column owner passes cells on as received: their values must stay the average's."""
    group = replicas(20, AveragingConfig(wait=1.0, flat=4), p=PL)
    me = group[0]
    me.submit(torch.zeros(PL), 8, now=0.0)
    assert me.layout.two_level
    assert all(me.place(me.layout.owner(r, c), 0, me.state.version.hash, *cell) is None
               for c, r, cell in me.layout.all_cells())


@pytest.mark.parametrize("fate", ["still arriving", "refused"])
def test_a_lent_cell_that_is_not_taken_leaves_the_base_and_the_state_its_own_memory(fate):
    """A cell lent to a frame that has not arrived by the close (or was refused: NaN) keeps the base
    values, and whatever the frame still writes into the memory it was lent does not reach the new
    state."""
    me, peer = replicas(2)
    base_values, base = me.state.params.clone(), me.state.version.hash
    me.submit(torch.zeros(P), 8, now=0.0)
    lo, hi = flat_range(me.group, peer.me)
    into = me.place(peer.me, 0, base, lo, hi)
    into.fill_(float("nan"))  # (the frame's bytes, as they come)
    if fate == "refused":
        message = Reduced(peer.me, 0, base, lo, hi, Contributors.of(me.group, [me.me, peer.me]), 16, into,
                          leaves=b"")
        assert "NaN" in me.offer(message)
    me.due(me.cfg.wait / 2)  # (its own cell: averaged alone)
    closed = me.close()
    into.fill_(7.0)  # (the rest of a frame still arriving)
    assert torch.equal(closed.state.params[lo:hi], base_values[lo:hi]) and closed.missing == ((lo, hi),)
    assert closed.state.version.hash == averaging.state_hash(closed.state.params)


def test_contributors_travel_as_a_bitmap_over_the_group():
    group = [f"{i:032x}" for i in range(20)]
    joiner = "f" * 32
    who = Contributors.of(group, [group[0], group[9], group[19], joiner])
    assert len(who.bits) == 3 and who.others == (joiner,) and len(who.group) == 8
    assert who.names(group) == sorted([group[0], group[9], group[19], joiner])
    assert who.problem(group, group_digest(group)) is None


@pytest.mark.parametrize("who, reason", [
    (lambda g: Contributors.of(g, []), "no contributors"),
    (lambda g: Contributors.of(g, [g[0]]).__class__(group_digest(g), b"\x01", (g[1],)), "repeated"),
    (lambda g: Contributors.of(g[:1], [g[0]]), "another group"),
    (lambda g: Contributors(group_digest(g), b"\x01\x00", ()), "bitmap of 2 bytes"),
    (lambda g: Contributors(group_digest(g), b"\x04", ()), "bitmap of 1 bytes"),  # a bit past the group's 2
])
def test_a_reduced_range_needs_contributors_of_its_group(who, reason):
    me, peer = replicas(2)
    me.submit(torch.zeros(P), 8, now=0.0)
    lo, hi = flat_range(me.group, peer.me)
    message = Reduced(peer.me, 0, me.state.version.hash, lo, hi, who(me.group), 16, torch.zeros(hi - lo), leaves=b"")
    assert reason in me.offer(message) and me.counters.rejected == 1


def test_stale_and_late_rounds_are_dropped():
    me, peer = replicas(2)
    for _ in range(2):  # me moves on to round 2 alone
        close_alone(me, torch.zeros(P))
    assert me.offer(Part(peer.me, 1, "x", 8, 0, P, torch.zeros(P))) == "late"
    assert me.offer(Part(peer.me, 0, "x", 8, 0, P, torch.zeros(P))) == "stale round"
    assert me.counters.late == 1 and me.counters.rejected == 1


def test_a_part_that_comes_after_its_range_was_averaged_is_late_and_its_sender_carries_it():
    me, peer = replicas(2)
    me.submit(torch.zeros(P), 8, now=0.0)
    [peer_part] = peer.submit(torch.ones(P), 8, now=0.0)
    [mine] = me.due(now=0.5)  # half the deadline passed: averaged without the peer's part
    assert me.offer(peer_part.message) == "late"
    peer.offer(mine.message)
    peer.due(now=0.5)
    closed = peer.close()
    lo, hi = flat_range(me.group, me.me)
    assert closed.carry[lo:hi].eq(1).all() and not closed.carry[:lo].any() and not closed.carry[hi:].any()


def test_a_part_on_another_base_is_never_averaged_in():
    me, peer = replicas(2)
    me.expected = {peer.me}
    assert me.offer(Part(peer.me, 0, "f" * 64, 8, 0, P, torch.ones(P))) == "held"
    me.submit(torch.zeros(P), 8, now=0.0)
    # still a member this round (its peers may not have heard what it is on yet, and must lay out the
    # same group): waited for until the deadline, and then out of the next group
    assert me.group == sorted([me.me, peer.me]) and not me.due(now=0.4) and len(me.due(now=0.5)) == 1
    assert not me.can_close(now=0.9) and me.can_close(now=1.0)
    closed = me.close()
    assert closed.contributors == [me.me] and me.expected == set()
    torch.testing.assert_close(closed.state.params, replicas(1)[0].state.params)


def test_a_part_with_a_norm_far_outside_its_peers_is_rejected():
    group = replicas(3)
    deltas = [torch.full((P,), 0.01), torch.full((P,), 0.012), torch.full((P,), 5.0)]
    exchange(group, deltas, [8, 8, 8])
    closed = group[0].close()
    assert sorted(closed.contributors) == sorted([group[0].me, group[1].me])
    assert "norm" in closed.rejected[group[2].me]
    torch.testing.assert_close(closed.state.params, replicas(1)[0].state.params + 0.011, rtol=0, atol=1e-6)


def test_a_part_behind_a_share_of_the_samples_may_be_that_much_smaller():
    """A joiner's first update, of a share of a round's steps, is accepted beside its peers' full
    ones; as small a part behind as many samples is not, nor is a large one that claims more."""
    def third_refused(deltas: list[float], samples: list[int]) -> str | None:
        group = replicas(3)
        exchange(group, [torch.full((P,), d) for d in deltas], samples)
        return group[0].close().rejected.get(group[2].me)

    assert third_refused([0.5, 0.6, 0.01], [400, 400, 8]) is None
    assert "norm" in third_refused([0.5, 0.6, 0.01], [400, 400, 400])
    assert "norm" in third_refused([0.5, 0.6, 500.0], [400, 400, 10**12])


def test_a_part_claiming_far_more_samples_than_its_peers_weighs_in_with_max_samples_ratio_times_theirs():
    """Claimed samples cannot be checked: in an honest owner's range, a peer claiming a million
    times its peers' samples (its norm within the band) counts as if it had max_samples_ratio times
    the median part's (or the owner's own, if larger); parts within that count as claimed. Every
    replica still ends with one state."""
    group = replicas(3, AveragingConfig(wait=1.0, max_samples_ratio=4.0))
    deltas = [torch.full((P,), 0.01), torch.full((P,), 0.012), torch.full((P,), 0.05)]
    exchange(group, deltas, [8, 10, 8_000_000])
    closed = [r.close() for r in group]
    counted = [8, 10, 4 * 10]  # (the median part: 10 samples)
    step = sum(d * n for d, n in zip([0.01, 0.012, 0.05], counted, strict=True)) / sum(counted)
    base = replicas(1)[0].state.params
    for honest in group[:2]:
        lo, hi = flat_range([r.me for r in group], honest.me)
        torch.testing.assert_close(closed[0].state.params[lo:hi], base[lo:hi] + step, rtol=0, atol=1e-6)
    assert len({c.state.version.hash for c in closed}) == 1
    assert all(sorted(c.contributors) == sorted(r.me for r in group) and not c.rejected for c in closed)
    assert [r.counters.capped for r in group] == [1, 1, 0]  # (in its own range, an owner averages as it likes)

    # with two, the reference is the owner's own part
    me, peer = replicas(2, AveragingConfig(wait=1.0, max_samples_ratio=2.0))
    exchange([me, peer], [torch.full((P,), 0.01), torch.full((P,), 0.02)], [8, 10**9])
    lo, hi = flat_range([me.me, peer.me], me.me)
    torch.testing.assert_close(me.close().state.params[lo:hi],
                               replicas(1)[0].state.params[lo:hi] + (0.01 * 8 + 0.02 * 16) / 24, rtol=0, atol=1e-6)

    # an infinite ratio caps nothing; NaN and ratios under 1 are refused
    me, peer = replicas(2, AveragingConfig(wait=1.0, max_samples_ratio=math.inf))
    exchange([me, peer], [torch.full((P,), 0.01), torch.full((P,), 0.02)], [8, 10**9])
    assert me.close().state.version.samples == 10**9 + 8 and me.counters.capped == 0
    for bad in (0.5, math.nan):
        with pytest.raises(ValueError, match="max_samples_ratio"):
            AveragingConfig(max_samples_ratio=bad)


def test_a_claim_capped_round_after_round_is_counted_every_time_and_logged_a_few_times(caplog):
    me, peer = replicas(2, AveragingConfig(wait=1.0, max_samples_ratio=2.0))
    me.quiet.period = math.inf  # (its window is in real time; these rounds, in none)
    with caplog.at_level(logging.WARNING, "spheroid.averaging"):  # (whatever a CLI test left the level at)
        for _ in range(8):
            exchange([me, peer], [torch.full((P,), 0.01), torch.full((P,), 0.02)], [8, 10**9])
            assert me.close().state.version == peer.close().state.version
    claims = [r for r in caplog.records if "claims 1000000000 samples" in r.getMessage()]
    assert me.counters.capped == 8 and len(claims) == me.quiet.burst < 8


def test_parts_of_a_share_of_a_round_pulling_the_median_down_cap_no_full_part():
    """Three replicas that trained a share of a round (joiners' first parts, a last round cut short)
    put the median at their samples; an owner whose own part is a full round's still counts its
    peers' full parts as claimed."""
    group = replicas(5, AveragingConfig(wait=1.0, max_samples_ratio=4.0))
    values, samples = [0.05, 0.05, 0.01, 0.01, 0.01], [80, 80, 8, 8, 8]
    exchange(group, [torch.full((P,), v) for v in values], samples)
    closed = [r.close() for r in group]
    step = sum(v * n for v, n in zip(values, samples, strict=True)) / sum(samples)
    base = replicas(1)[0].state.params
    for full in group[:2]:
        lo, hi = flat_range([r.me for r in group], full.me)
        torch.testing.assert_close(closed[0].state.params[lo:hi], base[lo:hi] + step, rtol=0, atol=1e-6)
        assert full.counters.capped == 0
    assert len({c.state.version.hash for c in closed}) == 1 and not closed[0].rejected


def test_version_rule_prefers_later_rounds_then_more_samples_then_smaller_hash():
    assert Version(3, 0, "b").preferred_over(Version(2, 999, "a"))
    assert Version(2, 20, "b").preferred_over(Version(2, 10, "a"))
    assert Version(2, 10, "a").preferred_over(Version(2, 10, "b"))
    assert not Version(2, 10, "a").preferred_over(Version(2, 10, "a"))


def test_adopting_a_state_keeps_local_progress_and_verifies_the_hash():
    me, peer = replicas(2)
    local = me.state.params + 0.5
    newer = close_alone(peer, torch.full((P,), 0.1)).state
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
        for out in r.submit(self.local[r.me] - r.state.params, 16, self.now):
            self.at(self.latency, self.deliver, out.to[0], out.message)
        self.at(r.cfg.wait / 2, self.try_close, r)
        self.at(r.cfg.wait, self.try_close, r)
        self.try_close(r)

    def replica(self, name: str) -> Replica:
        return next(r for r in self.group if r.me == name)

    def deliver(self, name: str, message: Part | Reduced) -> None:
        if name not in self.dead:
            r = self.replica(name)
            r.offer(message, self.now)
            self.try_close(r)

    def try_close(self, r: Replica) -> None:
        if r.me in self.dead:
            return
        for out in r.due(self.now):
            for peer in out.to:
                self.at(self.latency, self.deliver, peer, replace(out.message, sender=r.me))
        if not r.can_close(self.now):
            return
        ready = r.ready_at
        closed = r.close()
        self.closes.append((r.me, closed.state.version.round - 1, ready, self.now, len(closed.contributors)))
        self.local[r.me] = closed.state.params + (0 if closed.carry is None else closed.carry)
        for peer in self.group:
            if peer is not r:  # (synced: a member of its next group, as a node announces it)
                self.at(self.latency, self.announce, peer, r, closed.state.version, r.synced)
        self.maybe_fetch(r)
        self.train(r)

    def announce(self, r: Replica, sender: Replica, version: Version, synced: bool, joining: bool = False) -> None:
        if r.me in self.dead or sender.me in self.dead:
            return
        r.note_version(sender.me, version, synced, joining)
        self.maybe_fetch(r)

    def live(self) -> set[str]:
        return {r.me for r in self.group if r.me not in self.dead}

    def held(self, name: str, version: Version) -> SharedState | None:
        """The state peer `name` sends when asked for `version`, if it holds it."""
        peer = self.replica(name)
        if peer.me in self.dead or peer.state.version != version:
            return None
        return SharedState(version, peer.state.params.clone(), peer.state.momentum)

    def maybe_fetch(self, r: Replica) -> None:
        """What a node does with the versions it heard: fetch the preferred one it trusts from a holder."""
        version = r.choice(self.now < self.stop_at, self.live(), self.now)
        for peer, (announced, _) in sorted(r.announced.items()):
            if version is not None and announced == version and (state := self.held(peer, version)) is not None:
                self.at(2 * self.latency, self.fetched, r, state)
                return

    def fetched(self, r: Replica, state: SharedState) -> None:
        if (r.me in self.dead or not r.wants(state.version, in_round=self.now < self.stop_at)
                or r.vet(state, self.live(), self.now) is not None):
            return
        was_waiting = r.ready_at is not None
        self.local[r.me] = r.adopt(state, self.local[r.me])
        for peer in self.group:
            if peer is not r:  # (not a member: it joins, and trains until stop_at)
                self.at(self.latency, self.announce, peer, r, state.version, False, self.now < self.stop_at)
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
    restarted = Replica(victim.me, saved, victim.cfg, synced=False)  # as a node resumed from its checkpoint
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


def test_fake_clock_joiner_syncs_and_is_waited_for_only_until_the_row_stage():
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
    # rounds the others closed after it joined: held by the joiner at most until the row stage
    # (wait / 2 = 1 s), never to the deadline
    for me, _, ready, closed, _ in sim.closes:
        if me != joiner.me and ready > 6.2:
            assert closed - ready < 1.5
    sim.stop_at = 12.0
    sim.run(until=30.0)
    assert len(sim.hashes()) == 1
