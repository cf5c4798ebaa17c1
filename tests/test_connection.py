"""The asyncio connection over a real socket pair: a tensor streamed with the message that names it,
and every frame counted on both sides."""

import asyncio
import socket

import pytest
import torch

from spheroid.config import NodeConfig
from spheroid.node.accounting import Traffic
from spheroid.node.connection import Connection
from spheroid.node.node import open_session
from spheroid.wire.messages import Update

ME = {"addr": "127.0.0.1:1", "role": "worker", "blocks": [0], "boot": b"12345678"}


async def connected_pair() -> tuple[Connection, Connection, list]:
    """Two open connections over a socket pair (the second dialled), and what to close."""
    a, b = socket.socketpair()
    loop = asyncio.get_running_loop()
    pair = []
    for sock, name, dialler in ((a, "ab", False), (b, "cd", True)):
        session = open_session({**ME, "node": name * 16}, NodeConfig(), None, dialler, 1 << 26)
        _, conn = await loop.connect_accepted_socket(lambda s=session: Connection(Traffic(), s, timeout=10.0), sock)
        pair.append(conn)
    await asyncio.gather(*(c.open() for c in pair))
    return pair[0], pair[1], [a, b]


@pytest.mark.parametrize("numel", [0, 1000, (5 << 20) // 8])  # no chunk, one, three (1 MiB each)
def test_a_tensor_and_the_message_naming_it_arrive_together_and_every_frame_is_counted(numel):
    async def scenario():
        receiver, sender, socks = await connected_pair()
        try:
            serving = asyncio.create_task(receiver.recv())
            x = torch.randn(numel)
            message = Update(block=0, round=3, base="ab" * 32, samples=8, lo=0, hi=numel, age=0.5, stream=0)
            stream = await sender.send_tensor(x, then=message)
            got = await asyncio.wait_for(serving, 10)
            return x, stream, got, sender.traffic.by_type(), receiver.traffic.by_type()
        finally:
            for conn in (receiver, sender):
                await conn.close()
            for sock in socks:
                sock.close()

    x, stream, got, sent, received = asyncio.run(scenario())
    assert got.t == "update" and got.stream == stream and got.round == 3 and torch.equal(got.tensor, x)
    chunks = -(-numel * 4 // (1 << 20))
    for counts, direction in ((sent, "sent"), (received, "received")):
        frames = {kind: c["frames"] for kind, c in counts[direction].items() if kind.startswith(("stream", "update"))}
        assert frames == {"stream_begin": 1, "update": 1, **({"stream_chunk": chunks} if chunks else {})}
        assert counts[direction].get("stream_chunk", {"raw_bytes": 0})["raw_bytes"] == numel * 4
    assert sent["sent"]["update"]["wire_bytes"] == received["received"]["update"]["wire_bytes"]
