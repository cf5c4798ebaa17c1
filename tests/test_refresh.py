"""Refreshes by change: a holder sends a reader the change from the copy the reader holds, so the
copy's error stays that of one change instead of building up (spheroid/node/worker.py)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from spheroid.averaging import state_hash
from spheroid.node.worker import ReadersCopies
from spheroid.wire import through_codec


def trajectory(steps: int, n: int = 20_000) -> list[torch.Tensor]:
    """A holder's states: a random walk with a drift, as training moves a block."""
    g = torch.Generator().manual_seed(0)
    drift = torch.randn(n, generator=g) * 0.01
    states = [torch.randn(n, generator=g)]
    for _ in range(steps):
        states.append(states[-1] + drift + 0.01 * torch.randn(n, generator=g))
    return states


@pytest.mark.parametrize("codec", ["int4", "int2"])
def test_a_tracked_copy_keeps_the_error_of_one_change(codec):
    states = trajectory(30)
    genesis = states[0]
    holder = ReadersCopies()
    copy, untracked = genesis.clone(), genesis.clone()
    errors, untracked_errors = [], []
    for prev, state in zip(states, states[1:], strict=False):
        got = holder.change(state_hash(copy), {state_hash(genesis): (0, genesis)}, state, 1, codec)
        assert got is not None  # the holder knows the copy it made last time
        change, sent_in = got
        copy = copy + through_codec(change, sent_in)  # what the reader does with what arrives
        untracked = untracked + through_codec(state - prev, codec)  # changes between versions
        errors.append((copy - state).norm() / (state - prev).norm())
        untracked_errors.append((untracked - state).norm() / (state - prev).norm())
    # tracked: about the codec's error on one change (int4 0.16, int2 0.75 of it), not growing
    bound = {"int4": 0.25, "int2": 1.0}[codec]
    assert max(errors[5:]) < bound
    assert untracked_errors[-1] > 2 * errors[-1]  # untracked, what rounding lost adds up


def test_a_holder_that_does_not_know_the_copy_says_so_and_keeps_a_bounded_number():
    states = trajectory(3, n=100)
    holder = ReadersCopies(limit=2)
    assert holder.change("0" * 64, {}, states[1], 1, "int8") is None  # a copy made elsewhere: send a snapshot
    known = {state_hash(states[0]): (0, states[0])}
    for i, state in enumerate(states[1:]):
        assert holder.change(state_hash(states[0]), known, state, i + 1, "int8") is not None
    assert len(holder.copies) == 2


def test_a_change_from_a_state_rounds_old_goes_in_int8_and_later_ones_in_the_codec_asked_for():
    """A change from genesis (or a recent state) more than a round old is many rounds' worth: in
    int2 the copy would take rounds to come close. From a copy the holder made, or from a state
    a round old (every reader's first refresh in a swarm that starts together), the change goes
    in the codec asked for."""
    states = trajectory(3)
    genesis = states[0]
    known = {state_hash(genesis): (0, genesis)}
    holder = ReadersCopies()
    assert holder.change(state_hash(genesis), known, states[1], 1, "int2")[1] == "int2"
    change, codec = holder.change(state_hash(genesis), known, states[2], 2, "int2")
    assert codec == "int8"
    copy = genesis + through_codec(change, codec)
    change, codec = holder.change(state_hash(copy), {}, states[3], 3, "int2")
    assert codec == "int2"


def test_readers_refreshing_at_once_each_get_changes_from_their_own_copy():
    """A holder computes changes for several readers at once, in threads (the worker does it off
    the event loop): each reader's every refresh finds the copy its last one made, and every copy
    the holder keeps is bit for bit the one its reader holds."""
    states = trajectory(10, n=200_000)
    genesis = states[0]
    known = {state_hash(genesis): (0, genesis)}
    holder = ReadersCopies(limit=100)  # (8 readers x 10 refreshes: none forgotten)
    start = threading.Barrier(8)

    def reader(codec: str) -> list[str]:
        copy, hashes = genesis.clone(), []
        start.wait()
        for round_, state in enumerate(states[1:], start=1):
            got = holder.change(state_hash(copy), known, state, round_, codec)
            assert got is not None, "the holder lost track of this reader's copy"
            copy = copy + through_codec(*got)
            hashes.append(state_hash(copy))
        assert (copy - states[-1]).norm() < (genesis - states[-1]).norm() / 2
        return hashes

    with ThreadPoolExecutor(8) as pool:
        held = list(pool.map(reader, ["int8", "int4", "int2", "int8"] * 2))
    assert all(h in holder.copies for hashes in held for h in hashes)
    for hashes in held:
        for h in hashes:
            assert state_hash(holder.copies[h]) == h
