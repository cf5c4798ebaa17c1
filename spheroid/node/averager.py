"""The asyncio side of a block's averaging rounds: it moves parts and averaged ranges between the
`Replica` (spheroid/averaging.py, which decides everything) and the same-block peers.

One round: submit this node's update, stream each part to the member owning its range, then
send whatever the replica says is due (the averages of the ranges this node owns, once their parts
are in or their stage's time has come, and the cells it passes on), and close when every cell is
in (or the deadline passed). A node's training loop
(worker.py) calls `round`; bench/averaging.py calls it with synthetic updates to time it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import torch

from ..averaging import Closed, Contributors, Part, Reduced, Replica
from ..wire import Encoded, encode_stream, messages
from ..wire.tensors import CODEC_OPTIONS
from .connection import Connection, PeerGone
from .node import Node

log = logging.getLogger(__name__)


class Averager:
    def __init__(self, node: Node, block: int, replica: Replica, codec: str, compression: str,
                 changed: asyncio.Event | None = None) -> None:
        self.node, self.block, self.replica = node, block, replica
        self.codec, self.compression = CODEC_OPTIONS[codec].name, compression
        self.changed = changed or asyncio.Event()  # set whenever something arrives that may end a wait
        self.sends: list[asyncio.Task] = []
        node.handlers.update(update=self.on_update, reduced=self.on_reduced)
        node.lenders["reduced"] = self.place
        node.keep.append(replica.partners)

    async def round(self, delta: torch.Tensor, samples: int, interrupt: Callable[[], bool] = lambda: False
                    ) -> Closed | None:
        """One round with this node's update; the closed round, or None if `interrupt()` became true
        first (a preferred state to adopt: the round was on the old one)."""
        parts = self.replica.submit(delta, samples, time.monotonic())
        # peers gone: those connected now whose connection closes (a peer this node cannot reach may
        # still reach it, and a cell passed on may come when its owner is gone: those are waited for)
        connected = {p for p in self.replica.group if self.connected(p)}
        self.sends = [self.node.spawn(self._send(out.to[0], out.message)) for out in parts]
        while True:
            self.changed.clear()
            if interrupt():
                return None
            now = time.monotonic()
            for out in self.replica.due(now):
                self.sends.append(self.node.spawn(self._broadcast(out.message, out.to)))
            gone = {p for p in connected if not self.connected(p)}
            if self.replica.can_close(now, gone):
                return self.replica.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.01, self.replica.deadline() - now)):
                    await self.changed.wait()

    async def flush(self) -> None:
        """Wait for this node's last sends (so that a final update is not overtaken)."""
        await asyncio.gather(*self.sends, return_exceptions=True)

    def connected(self, peer: str) -> bool:
        conn = self.node.conns.get(peer)
        return conn is not None and not conn.closed

    async def _broadcast(self, what: Reduced, peers: tuple[str, ...]) -> None:
        """An average to each of `peers`, encoded once for all of them."""
        raw = self.codec == "raw" and self.compression == "none"  # (nothing to encode: sent from its memory)
        encoded = None if raw or len(peers) == 1 else await asyncio.to_thread(encode_stream, what.delta, self.codec,
                                                                               self.compression)
        await asyncio.gather(*(self._send(peer, what, encoded) for peer in peers))

    async def _send(self, peer: str, what: Part | Reduced, encoded: Encoded | None = None) -> None:
        """A part of this node's update, or an average, to a peer (`encoded`: its delta, already
        encoded)."""
        conn = await self.node.reach(peer)
        if conn is None:
            return  # gone, or out of reach: its cells will be missing this round, or it will miss this one
        fields = {"block": self.block, "round": what.round, "base": what.base, "samples": what.samples,
                  "lo": what.lo, "hi": what.hi, "age": what.age, "stream": 0}  # (send_tensor names the stream, or
        #                                                                          puts the tensor in the message)
        if isinstance(what, Part):
            message = messages.Update(**fields)
        else:
            who = what.contributors
            message = messages.Reduced(**fields, group=who.group, members=who.bits, others=list(who.others),
                                       leaves=what.leaves)
        with contextlib.suppress(PeerGone):
            await conn.send_tensor(what.delta if encoded is None else encoded, self.codec, self.compression,
                                   then=message)

    def place(self, peer: str, fields: dict, dtype: str, nbytes: int) -> torch.Tensor | None:
        """Where an averaged cell's values are read as they arrive (`Replica.place`). `fields` are
        the frame's, not yet checked: anything unexpected gets memory of its own, and is checked as
        usual once it is in."""
        block, round_, base, lo, hi = fields.get("block"), fields.get("round"), fields.get("base"), fields.get("lo"), \
            fields.get("hi")
        if (dtype != "float32" or type(block) is not int or type(round_) is not int or type(lo) is not int
                or type(hi) is not int or type(base) is not str or block != self.block or nbytes != 4 * (hi - lo)):
            return None
        return self.replica.place(peer, round_, base, lo, hi)

    async def on_update(self, conn: Connection, msg: messages.Message) -> None:
        if msg.block != self.block:
            self.node.quiet.log(logging.WARNING, "other block", "update from %s is for block %d; this node trains "
                                "block %d", conn.label[:8], msg.block, self.block)
            return
        self.replica.offer(Part(conn.label, msg.round, msg.base, msg.samples, msg.lo, msg.hi, msg.tensor,
                                age=msg.age), time.monotonic())
        self.changed.set()

    async def on_reduced(self, conn: Connection, msg: messages.Message) -> None:
        if msg.block != self.block or not all(isinstance(c, str) for c in msg.others):
            self.node.quiet.log(logging.WARNING, "other block", "reduced range from %s refused: block %d, or "
                                "contributors that are not node ids", conn.label[:8], msg.block)
            return
        who = Contributors(msg.group, msg.members, tuple(msg.others))
        self.replica.offer(Reduced(conn.label, msg.round, msg.base, msg.lo, msg.hi, who, msg.samples, msg.tensor,
                                   age=msg.age, leaves=msg.leaves), time.monotonic())
        self.changed.set()
