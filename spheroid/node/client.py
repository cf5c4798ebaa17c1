"""A client of the swarm: connects to one node, does the handshake as role "client", asks things.

Clients are not members: nodes never gossip them. `spheroid status` is built on this.
"""

from __future__ import annotations

import asyncio
import os

from ..config import NodeConfig, parse_addr
from .accounting import Traffic
from .connection import Connection
from .node import handshake, ssl_contexts


async def connect(addr: str, cfg: NodeConfig, secret: bytes | None = None) -> Connection:
    """An authenticated connection to the node at addr, reading replies in the background.

    cfg supplies the swarm, the timeout and the TLS files; the client takes a fresh id each time.
    """
    host, port = parse_addr(addr)
    _, client_ssl = ssl_contexts(cfg)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=client_ssl), cfg.timeout)
    conn = Connection(reader, writer, Traffic(), cfg.timeout)
    me = {"node": os.urandom(16).hex(), "addr": "", "role": "client", "blocks": [], "boot": os.urandom(8)}
    try:
        await handshake(conn, me, cfg.swarm, secret)
    except BaseException:
        await conn.close()
        raise

    async def ignore(_conn: Connection, _msg: dict) -> None:
        return None

    conn.reader_task = asyncio.get_running_loop().create_task(conn.serve(ignore, idle_timeout=3600))
    return conn


async def fetch_status(addr: str, cfg: NodeConfig, secret: bytes | None = None) -> dict:
    """The status of the node at addr, as the node reports it."""
    conn = await connect(addr, cfg, secret)
    try:
        return (await conn.request({"t": "status"}))["status"]
    finally:
        await conn.close()
