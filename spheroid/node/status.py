"""A node's status, as it reports it: a `NodeStatus` (spheroid/status.py: what `spheroid status`
prints and peers and launchers read), and the status line.

`Reporting` is mixed into `Node` (node.py); what a node does besides membership (training,
serving) adds its own part of the status (`status_parts`: "serving" and "training", each a typed
part) and its status-line fields (`line_parts`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..progress import QuietLog
from ..status import NodeStatus, PeerEntry
from ..wire import VERSION
from ..wire.messages import Message, StatusReply
from .accounting import CLIENTS
from .connection import Connection

log = logging.getLogger(__name__)


class Reporting:
    """The status side of a `Node` (a mixin: the node holds the state it reports)."""

    async def _on_status(self, conn: Connection, msg: Message) -> None:
        await conn.send(StatusReply(re=msg.id, status=self.status()))

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.status_interval)
            log.info("%s", self.status_line())
            QuietLog.flush_all()  # (what the rate-limited lines left out of a flood that has stopped)

    def node_status(self) -> NodeStatus:
        peers = []
        for node, conn in self.conns.items():
            info = self.known.get(node)
            peers.append(PeerEntry(node=node, addr=conn.hello.addr, role=conn.hello.role,
                                   blocks=tuple(conn.hello.blocks), serves=tuple(conn.hello.serves or ()),
                                   rtt_ms=info.rtt_ms if info else None, traffic=self.traffic.summary(node)))
        return NodeStatus(
            node=self.id, swarm=self.cfg.swarm, addr=self.cfg.address, role=self.cfg.role,
            blocks=tuple(self.cfg.blocks), serves=tuple(self.cfg.serves), version=VERSION,
            uptime_s=time.monotonic() - self.started,
            authenticated=self.secret is not None, tls=self._ssl_server is not None,
            peers=tuple(sorted(peers, key=lambda p: p.node)), known=len(self.known),
            traffic=self.traffic.summary(), traffic_by_type=self.traffic.summary_by_type(),
            swarm_traffic=self.traffic.summary(exclude={CLIENTS}),  # between members only
            **{name: part() for name, part in self.status_parts.items()},
        )

    def status(self) -> dict:
        """node_status() as the map a status_reply carries."""
        return self.node_status().to_dict()

    def status_line(self) -> str:
        totals = self.traffic.summary()
        rtts = [i.rtt_ms for n, i in self.known.items() if n in self.conns and i.rtt_ms is not None]
        rtt = f"{sum(rtts) / len(rtts):.1f} ms" if rtts else "-"
        extra = "".join(f"{part()} | " for part in self.line_parts)
        return (f"node {self.id[:8]} | {extra}peers {len(self.conns)} connected, {len(self.known)} known | "
                f"sent {totals.sent.wire_bytes / 2**20:.2f} MiB, received "
                f"{totals.received.wire_bytes / 2**20:.2f} MiB | mean RTT {rtt}")
