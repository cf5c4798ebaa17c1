"""bench/simulate.py at a small size: the round logic under churn, stragglers and a partition."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from simulate import Config, simulate  # noqa: E402


def test_a_churning_partitioned_swarm_keeps_its_deadlines_agrees_and_settles():
    result = simulate(Config(nodes=40, blocks=2, minutes=3, partition=(60.0, 100.0)))
    assert result["rounds_closed"] > 100
    assert result["closed_by_deadline"] == 1.0  # nobody waits past its deadline
    assert result["same_cells_same_state"] == 1.0  # the same cells in: the same state, every time
    assert result["members_on_the_main_state"]["mean"] > 0.8  # the members mostly end a round alike
    assert result["joiners"] >= 10 and result["joiners_became_members"] >= 1
    # joiners train the rest of their holder's round, so most with the time become members
    assert 2 * result["joiners_in_time_became_members"] >= result["joiners_in_time"] >= 6
    assert result["state_fetches"] >= result["joiners_became_members"]
    assert all(n == 1 for n in result["distinct_states_per_block_at_end"].values())  # settled on one state


def test_in_a_large_group_a_node_sends_to_its_row_and_column_not_to_every_replica():
    result = simulate(Config(nodes=160, blocks=2, minutes=2, partition=(40.0, 60.0), churn=0.05))
    n = result["replicas_per_block"]  # 80: rows of 8 or 9, 8 columns
    assert result["same_cells_same_state"] == 1.0 and result["closed_by_deadline"] == 1.0
    assert result["peers_per_node_round"]["mean"] < 2 * math.isqrt(n) + 4 < n - 1
    assert result["bytes_sent_per_node_round_over_block"]["mean"] < 2.2
    assert all(k == 1 for k in result["distinct_states_per_block_at_end"].values())
