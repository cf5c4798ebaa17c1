"""The averager (spheroid/node/averager.py) between real nodes on loopback, in one process."""

import asyncio

import pytest
import torch

from spheroid.averaging import AveragingConfig, Replica, SharedState, state_hash
from spheroid.config import NodeConfig
from spheroid.launch import free_ports
from spheroid.node.averager import Averager
from spheroid.node.identity import load_or_create
from spheroid.node.node import Node

N_PARAMS = 3 * 40_000  # each member's cell (40,000 float32) travels in its message


@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_averaged_cells_are_read_into_the_next_state_and_every_replica_agrees(tmp_path, outer):
    """Three nodes average one round. Each cell from its owner is read straight into the receiver's
    next parameters (the memory `Replica.place` lends), and the outer step applied there gives the
    exact result (plain: the base plus the average; Nesterov from zero momentum: the base plus
    lr (1 + mu) times the average), the same on every replica."""
    averaging = AveragingConfig(wait=20.0, outer=outer)
    momentum = torch.zeros(N_PARAMS) if outer == "nesterov" else None
    genesis = torch.randn(N_PARAMS, generator=torch.Generator().manual_seed(0))
    deltas = [torch.randn(N_PARAMS, generator=torch.Generator().manual_seed(1 + i)) * 0.01 for i in range(3)]

    async def scenario() -> tuple[list, list[dict]]:
        ports = free_ports(3)
        nodes = []
        for i, port in enumerate(ports):
            cfg = NodeConfig(listen=f"127.0.0.1:{port}", peers=tuple(f"127.0.0.1:{p}" for p in ports[:i]),
                             identity=str(tmp_path / f"node-{i}.json"), blocks=(0,))
            nodes.append(Node(cfg, load_or_create(cfg.identity)))
        for node in nodes:
            await node.start()
        try:
            async with asyncio.timeout(60):
                while any(len([c for c in n.conns.values() if not c.closed]) < 2 for n in nodes):
                    await asyncio.sleep(0.05)
            averagers, lent = [], [{} for _ in nodes]
            for node, log in zip(nodes, lent, strict=True):
                replica = Replica(node.id, SharedState.create(0, 0, genesis.clone(), momentum), averaging,
                                  expected=set(node.conns))
                place = replica.place

                def recorded(sender, round_, base, lo, hi, place=place, log=log):
                    into = place(sender, round_, base, lo, hi)
                    if into is not None:
                        log[lo, hi] = into.data_ptr()
                    return into

                replica.place = recorded
                averagers.append(Averager(node, 0, replica, "fp32", "none"))
            closed = await asyncio.gather(*(a.round(d, 8) for a, d in zip(averagers, deltas, strict=True)))
            return closed, lent
        finally:
            for node in nodes:
                await node.stop()

    closed, lent = asyncio.run(scenario())
    average = sum(deltas) / 3
    step = 1.0 if outer == "average" else averaging.outer_lr * (1 + averaging.outer_momentum)
    expected = genesis + step * average
    for c, log in zip(closed, lent, strict=True):
        assert len(c.contributors) == 3 and not c.missing
        assert torch.allclose(c.state.params, expected, atol=1e-6)
        assert c.state.version.hash == state_hash(c.state.params, c.state.momentum)
        # the two cells owned by the others went into place: they are this state's own memory
        assert len(log) == 2
        for (lo, _), ptr in log.items():
            assert ptr == c.state.params[lo:].data_ptr()
    assert len({c.state.version.hash for c in closed}) == 1
