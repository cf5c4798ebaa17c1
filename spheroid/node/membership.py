"""A node's membership: the peers it knows, the gossip that spreads them, the seeds it re-dials.

`Membership` is mixed into `Node` (node.py), whose connections (`conns`), known-peers table
(`known`), configuration and tasks it uses: gossip swaps samples of peer lists with connected
peers (less often while membership does not change) and dials a few of the peers it learns of,
oldest-learned first, backing off from failures; a peer neither connected nor advertised for
`forget_after` is forgotten, and the table is bounded (`PeerTable`: once full, a newcomer takes the
place of a random entry that is neither connected nor a seed, found in O(1)); the seed loop re-dials
the seed list so a split swarm heals. The peer table is saved beside the node's identity when it stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from ..checkpoint import atomic_write
from ..config import parse_addr
from ..wire import ProtocolError
from ..wire.messages import MAX_PEER_ENTRIES, Message, Peers, PeersReply, validate_peer
from ..wire.session import is_node_id
from .connection import Connection, PeerGone

log = logging.getLogger(__name__)

DIALS_AT_ONCE = 16  # dials to learned peers in flight at once
SETTLED_FANOUT = 2  # peers a node connected to all it knows asks for peer lists once membership settles
# a full table's evictions: entries looked at at random for one to evict, then at most this many
# more in a row from a random one (so a table of up to EVICT_SCAN entries is always searched whole)
EVICT_PICKS, EVICT_SCAN = 16, 256
EVICTIONS_PER_LIST = 16  # entries one peer list (or busy refusal) may evict from a full table


@dataclass
class PeerInfo:
    node: str
    addr: str
    role: str
    blocks: list[int]
    serves: list[int] = field(default_factory=list)  # blocks it serves for inference
    last_seen: float = field(default_factory=time.monotonic)
    rtt_ms: float | None = None
    learned: float = field(default_factory=time.monotonic)  # peers are dialled oldest-learned first
    failures: int = 0  # dials that failed, or refusals (busy), in a row
    retry_at: float = 0.0  # not dialled again before this (backing off after failures)
    unreachable: bool = False  # the last dial of its address failed (a refusal is an answer: not that)

    def entry(self) -> dict:
        return {"node": self.node, "addr": self.addr, "role": self.role, "blocks": self.blocks, "serves": self.serves}


class PeerTable(dict[str, PeerInfo]):
    """The known-peers table: PeerInfo by node id, as a dict, that also keeps its ids in a list (a
    deletion moves the last id into the gap), so that `evict` finds an entry to drop in O(1) rather
    than scanning all 10,000 for every newcomer of a full table (160 members listing 64 unknown
    peers each had blocked the event loop for 5-7 s). Seeds are the entries at a --peer address or
    with a node id a seed dial reached (`seed_nodes`)."""

    def __init__(self, seeds: Iterable[str] = ()) -> None:
        super().__init__()
        self._ids: list[str] = []
        self._at: dict[str, int] = {}  # node id -> its index in _ids
        self.seed_addrs = frozenset(seeds)
        self.seed_nodes: set[str] = set()

    def __setitem__(self, node: str, info: PeerInfo) -> None:
        if node not in self._at:
            self._at[node] = len(self._ids)
            self._ids.append(node)
        super().__setitem__(node, info)

    def __delitem__(self, node: str) -> None:
        super().__delitem__(node)
        self.seed_nodes.discard(node)  # (a seed dial that reaches it again says so again)
        i, last = self._at.pop(node), self._ids.pop()
        if last != node:
            self._ids[i], self._at[last] = last, i

    # (dict's own versions of these would bypass the index)
    def pop(self, node: str, *default):
        if node not in self:
            return dict.pop(self, node, *default)
        info = self[node]
        del self[node]
        return info

    def popitem(self) -> tuple[str, PeerInfo]:
        node = next(reversed(self))
        return node, self.pop(node)

    def clear(self) -> None:
        super().clear()
        self._ids.clear()
        self._at.clear()

    def setdefault(self, node: str, default: PeerInfo) -> PeerInfo:
        if node not in self:
            self[node] = default
        return self[node]

    def update(self, *args, **kwargs) -> None:
        for node, info in dict(*args, **kwargs).items():
            self[node] = info

    def __ior__(self, other):
        self.update(other)
        return self

    def evictable(self, node: str, connected: Container[str]) -> bool:
        return node not in connected and node not in self.seed_nodes and self[node].addr not in self.seed_addrs

    def evict(self, connected: Container[str]) -> str | None:
        """Drop a random entry that is neither connected nor a seed; its id, or None if none was found.
        A uniform pick among them in all but a table almost all connected or seeds: EVICT_PICKS
        entries at random, then up to EVICT_SCAN in a row from a random one, so at most
        EVICT_PICKS + EVICT_SCAN looks however large the table."""
        n = len(self._ids)
        if not n:
            return None
        start = random.randrange(n)
        picks = [random.randrange(n) for _ in range(EVICT_PICKS)]
        for i in [*picks, *((start + k) % n for k in range(min(n, EVICT_SCAN)))]:
            if self.evictable(node := self._ids[i], connected):
                del self[node]
                return node
        return None


def backoff(base: float, times: int) -> float:
    """Seconds to wait before trying a peer again after `times` failures (or refusals): doubling, at most 300."""
    return min(300.0, base * 2**times)


class Membership:
    """The membership side of a `Node`: what it knows of its peers, and gossip (a mixin: the node
    holds the state, `conns`, `known`, `cfg` and the rest)."""

    def peers_holding(self, block: int) -> list[Connection]:
        """Open connections to members that announced `block`, in node-id order."""
        return [c for n, c in sorted(self.conns.items()) if not c.closed and block in c.hello.blocks]

    async def _on_peers(self, conn: Connection, msg: Message) -> None:
        await conn.send(PeersReply(re=msg.id, peers=self._peer_sample()))

    def _peer_sample(self) -> list[dict]:
        """A random sample of the peers this node is connected to (what gossip and a `busy` refusal carry)."""
        entries = [self.known[n].entry() for n in self.conns if n in self.known]
        return random.sample(entries, min(len(entries), MAX_PEER_ENTRIES))

    async def _gossip_loop(self) -> None:
        """Gossip every gossip_interval until membership is settled (nothing new learned, every peer
        known connected or the connections full); then twice as long each time, up to gossip_max (a
        settled swarm that averages rarely moved much of its bytes in peer lists every 3 s); a peer
        connecting or leaving brings the interval back down at once."""
        interval = self.cfg.gossip_interval
        while True:
            try:
                async with asyncio.timeout(interval):  # (not wait_for, which can swallow a cancellation)
                    await self._membership_changed.wait()
            except TimeoutError:
                pass
            else:
                await asyncio.sleep(self.cfg.gossip_interval)  # (let a burst of changes settle first)
            changed = self._membership_changed.is_set()
            self._membership_changed.clear()
            settled = await self.gossip_once(everyone=changed or interval == self.cfg.gossip_interval)
            interval = min(2 * interval, self.cfg.gossip_max) if settled and not changed else self.cfg.gossip_interval

    async def gossip_once(self, everyone: bool = True) -> bool:
        """Ask every connected peer for a sample of its peers, all at once so a slow peer delays
        nobody; learn new ones, forget stale ones, and start dialling a few. Not `everyone` (membership
        looked settled) and connected to every peer it knows, it asks only SETTLED_FANOUT of them at
        random: there is nothing to keep fresh that its connections do not, and news of a joiner
        still spreads peer to peer. Whether membership looks settled: nothing new learned, and no
        known peer left to connect to while there is room."""
        now = time.monotonic()
        known = len(self.known)
        asked = list(self.conns.values())
        if not everyone and all(n in self.conns for n in self.known):
            asked = random.sample(asked, min(len(asked), SETTLED_FANOUT))
        await asyncio.gather(*(self._ask_peers(conn, now) for conn in asked))
        learned = max(0, len(self.known) - known)
        for node in [n for n in self.conns if n in self.known]:
            self.known[node].last_seen = now
        for node, info in list(self.known.items()):
            if node not in self.conns and now - info.last_seen > self.cfg.forget_after:
                self.quiet.log(logging.INFO, "forget", "forgetting peer %s (%s): unreachable for %.0fs", node[:8],
                               info.addr, now - info.last_seen)
                del self.known[node]
        # dial in the background, in the order peers were learned, backing off from failures: peers
        # that fake entries push in later wait behind the real ones, and dead ones leave the queue
        due = [i for n, i in self.known.items() if n not in self.conns and i.retry_at <= now and i.addr
               and i.addr not in self._dialing]
        room = min(self.cfg.max_peers - len(self.conns), DIALS_AT_ONCE - len(self._dialing))
        for info in sorted(due, key=lambda i: (i.failures, i.learned))[: max(0, room)]:
            self.spawn(self._dial_learned(info))
        unconnected = any(n not in self.conns and i.addr for n, i in self.known.items())
        return not learned and not (unconnected and len(self.conns) < self.cfg.max_peers)

    async def _dial_learned(self, info: PeerInfo) -> None:
        if await self.dial(info.addr) is None:
            self._back_off(info)  # (its first pong clears the failures: a peer can also say busy once dialled)
            info.unreachable = True

    def _back_off(self, info: PeerInfo) -> None:
        """Dial a peer that failed, or said it is full, again only after a while, longer each time."""
        info.failures += 1
        info.retry_at = time.monotonic() + backoff(self.cfg.gossip_interval, info.failures)

    async def _ask_peers(self, conn: Connection, now: float) -> None:
        try:
            reply = await conn.request(Peers())
            self._learn_all(reply.peers, "peers_reply", now)
        except PeerGone as exc:
            log.debug("gossip with %s failed: %s", conn.label[:8], exc)
        except ProtocolError as exc:
            self.quiet.log(logging.WARNING, "gossip", "%s sent a bad peer list (%s); closing", conn.label[:8],
                           exc.message)
            await conn.refuse(exc)

    def _learn_all(self, entries: list, what: str, now: float | None = None) -> None:
        """Learn the peers a peer listed (in a peers_reply, or with a busy refusal); ProtocolError if the
        list is malformed."""
        if len(entries) > MAX_PEER_ENTRIES:
            raise ProtocolError("bad_field", f"{what} lists {len(entries)} peers, more than {MAX_PEER_ENTRIES}")
        now = time.monotonic() if now is None else now
        evicted = 0  # (one list's share of a full table: EVICTIONS_PER_LIST; what it lists beyond is not learned)
        for entry in entries:
            evicted += self.learn(validate_peer(entry), now, evict=evicted < EVICTIONS_PER_LIST)

    def learn(self, entry: dict, now: float, evict: bool = True) -> bool:
        """A peer entry (node, addr, role, blocks, serves) heard from another node: kept in the known-peers
        table, which gossip dials from, unless it is this node, a client or malformed. For a peer known
        already, the address heard replaces the known one only while dials to that one fail (the
        peer came back elsewhere): a working address is never replaced by hearsay. A new peer finding
        the table full takes the place of a random peer neither connected nor a seed (`PeerTable.evict`),
        if `evict`, and is dropped otherwise. Whether it evicted one."""
        node = entry["node"]
        if node == self.id or entry["role"] == "client" or not is_node_id(node):
            return False
        try:
            parse_addr(entry["addr"])
        except ValueError:
            log.debug("ignoring peer %s with address %r", node[:8], entry["addr"])
            return False
        info = self.known.get(node)
        evicted = False
        if info is None:
            if len(self.known) >= self.cfg.max_known:  # full: a random peer not connected (nor a seed) makes room
                if not evict or self.known.evict(self.conns) is None:
                    return False
                evicted = True
            self.known[node] = PeerInfo(node, entry["addr"], entry["role"], list(entry["blocks"]),
                                        list(entry.get("serves", [])), now, learned=now)
        elif node not in self.conns:
            info.last_seen = now  # someone is still connected to it
            if info.unreachable and entry["addr"] != info.addr:  # (tried when its back-off is over, as before)
                log.debug("peer %s: trying %s instead of %s, which failed", node[:8], entry["addr"], info.addr)
                info.addr, info.unreachable = entry["addr"], False
        return evicted

    async def _seed_loop(self) -> None:
        retry = 0.25  # while alone, retry the seeds soon (they may be starting too), backing off
        while True:
            connected, now = {c.hello.addr for c in self.conns.values()}, time.monotonic()
            due = [a for a in self.cfg.peers if a not in connected and self._seeds_busy.get(a, (0, 0.0))[1] <= now]
            dialled = await asyncio.gather(*(self.dial(a) for a in due))
            self.known.seed_nodes.update(c.label for c in dialled if c is not None)  # (never evicted)
            if any(dialled):  # just (re)joined: learn the membership now rather than at the next gossip
                await self.gossip_once()
            retry = self.cfg.seed_interval if self.conns else min(2 * retry, self.cfg.seed_interval)
            await asyncio.sleep(retry)

    def write_state(self) -> None:
        entries = [p.entry() for p in self.known.values()]
        atomic_write(self.state_file, json.dumps({"node": self.id, "peers": entries}, indent=1).encode())
