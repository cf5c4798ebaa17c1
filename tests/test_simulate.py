"""bench/simulate.py at a small size: the round logic under churn, stragglers and a partition."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from simulate import Config, simulate  # noqa: E402


def test_a_churning_partitioned_swarm_keeps_its_deadlines_agrees_and_settles():
    result = simulate(Config(nodes=40, blocks=2, minutes=3, partition=(60.0, 100.0)))
    assert result["rounds_closed"] > 100
    assert result["closed_by_deadline"] == 1.0  # nobody waits past its deadline
    assert result["complete_rounds_agreeing"] == 1.0  # a group's complete round: one hash
    assert result["joiners"] >= 10 and result["joiners_became_members"] >= 1
    assert result["state_fetches"] >= result["joiners_became_members"]
    assert all(n == 1 for n in result["distinct_states_per_block_at_end"].values())  # settled on one state
    # a node messages at most its block's other replicas (and the joiners on its state) in a round
    assert result["peers_per_node_round"]["max"] <= result["replicas_per_block"] - 1 + result["joiners"]
