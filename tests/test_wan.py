"""The WAN emulator of bench/wan.py: delay and bandwidth as configured, data intact, both directions."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from wan import Link, LinkSpec  # noqa: E402

from spheroid.launch import free_port  # noqa: E402


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


def test_link_adds_delay_caps_bandwidth_and_keeps_bytes():
    async def run() -> tuple[float, float, bytes, bytes]:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        target = server.sockets[0].getsockname()[:2]
        port = free_port()
        link = Link(("127.0.0.1", port), target, LinkSpec(delay_ms=50, mbit=8))
        await link.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        writer.write(b"x")
        await reader.readexactly(1)
        rtt = time.monotonic() - started
        payload = os.urandom(1 << 20)  # 1 MiB at 8 Mbit/s: about 1 s each way, pipelined
        started = time.monotonic()
        writer.write(payload)
        back = await reader.readexactly(len(payload))
        elapsed = time.monotonic() - started
        writer.close()
        await link.close()
        server.close()
        return rtt, elapsed, payload, back

    rtt, elapsed, payload, back = asyncio.run(run())
    assert back == payload
    assert 0.1 <= rtt < 1.5  # two one-way delays of 50 ms, generous above
    assert 1.0 <= elapsed < 10  # 8 Mib at 8 Mbit/s takes at least a second
