"""The node: one asyncio process with a TCP server, an authenticated handshake and gossip membership.

Every connection, inbound or outbound, starts with the handshake that its `wire.Session` runs
(`hello` both ways, then proofs when the swarm has a secret); nothing else is accepted before it
completes, and it must complete within `handshake_timeout`. Connections still in their handshake
are capped in all and per source address. After that the node answers pings, peer lists and status
requests, and runs four loops: ping (RTT and liveness, clients included), gossip (swap samples of
peer lists, dial a few peers it learns of; less often while membership does not change), seeds
(re-dial the seed list so a split swarm heals) and a status line. A connection that stays silent
past `dead_after` is dropped; a peer that is neither connected nor advertised for `forget_after`
is forgotten; the known-peers table is bounded. Incoming tensor streams of all connections share
one memory budget. Membership (the peer table, gossip, the seeds) is membership.py's and the status
report status.py's, both mixed into `Node`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import itertools
import logging
import os
import signal
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from ..config import NodeConfig, parse_addr
from ..progress import QuietLog
from ..status import ServingStatus, TrainingStatus
from ..wire import ProtocolError, encode
from ..wire.codec import Budget
from ..wire.messages import (
    REPLIES,
    Bye,
    Error,
    Hello,
    Message,
    Ping,
    Pong,
    ProbeReply,
)
from ..wire.session import Lender, Session
from ..wire.tensors import DTYPE_NAMES, as_view
from .accounting import CLIENTS, Traffic
from .connection import STALLED_TIMEOUTS, Connection, PeerGone, PeerRefused, dial, handshake_failure, listen
from .identity import Identity
from .membership import Membership, PeerInfo, PeerTable, backoff
from .status import Reporting
from .tls import TlsFailed

log = logging.getLogger(__name__)

RTT_EVERY = 15  # ping intervals between the pings a node sends to a peer that dialled it (for the RTT)
SEED_WARN_S = 5.0  # a seed that cannot be reached for this long is warned of
SERVING_REQUESTS = ("generate", "score")  # requests only a serving node answers
LOOP_RESTART_S = 5.0  # pause before a background loop that failed starts again
# bytes of large frames read into buffers of their own, all connections together (beyond it, a
# frame waits in its connection's scratch buffer as its bytes arrive)
FRAMES_IN_FLIGHT = 64 << 20


def tune_allocator() -> None:
    """Keep the receive path's frame-sized buffers (up to 4 MiB, several allocated and freed per stream
    chunk) and a round's block-sized vectors (up to 32 MiB, glibc's largest threshold) on the heap
    rather than in fresh mmaps whose pages fault in on every use. glibc's dynamic threshold otherwise
    flips between the two with the order of allocations: one such flip halved a node's stream
    throughput (bench/wire.py, 0.46 instead of 0.8 of a raw socket), and a 16 MiB vector in a fresh
    mmap costs 4,097 page faults (13 ms) each time. Call once per node process; does nothing without
    glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt parameters, from malloc.h
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 128 << 20)


def open_session(me: dict, cfg: NodeConfig, secret: bytes | None, dialler: bool, budget: Budget | int,
                 frames: Budget | None = None, lend: Lender | None = None) -> Session:
    """The session of one connection, as this node (or client) speaks it."""
    return Session(me, dialler=dialler, swarm=cfg.swarm, secret=secret, budget=budget, frames=frames, lend=lend)


def ssl_contexts(cfg: NodeConfig) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(server, client) TLS contexts, or (None, None) without --tls-cert. A CA makes TLS mutual."""
    if not cfg.tls_cert:
        return None, None
    try:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=cfg.tls_ca)
        server.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.tls_ca)
        client.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except ssl.SSLError as exc:  # (its own text, "[SSL] PEM lib", names no file)
        files = ", ".join(f for f in (cfg.tls_cert, cfg.tls_key, cfg.tls_ca) if f)
        raise ValueError(f"cannot load TLS from {files}: {exc.reason or exc}; give a PEM certificate "
                         f"(--tls-cert), its private key (--tls-key) and a PEM CA (--tls-ca)") from exc
    client.check_hostname = False  # peers are addressed by IP; the swarm's CA is what is trusted
    if cfg.tls_ca:
        server.verify_mode = ssl.CERT_REQUIRED
    else:
        client.verify_mode = ssl.CERT_NONE
    return server, client


class Node(Membership, Reporting):
    def __init__(self, cfg: NodeConfig, identity: Identity, secret: bytes | None = None) -> None:
        self.cfg = cfg
        self.id = identity.node_id
        self.identity = identity
        self.secret = secret
        self.traffic = Traffic()
        self.conns: dict[str, Connection] = {}
        self.known = PeerTable(cfg.peers)  # at most cfg.max_known (beyond: eviction, membership.py)
        self.clients: set[Connection] = set()
        self.budget = Budget(cfg.recv_budget)  # incoming streams of all connections together
        self.frames = Budget(FRAMES_IN_FLIGHT)  # large frames being read into place, all connections together
        self.unauthenticated: collections.Counter[str] = collections.Counter()  # handshakes in progress by host
        self.quiet = QuietLog(log)
        # peers joining and leaving: a swarm's start logs dozens at once, but anyone can connect and leave in a loop
        self.membership_log = QuietLog(log, burst=32)
        self._pinging: set[Connection] = set()  # connections with a ping on its way (one at a time)
        self._seeds_failing: dict[str, float] = {}  # seed address -> when dialling it first failed
        self._seeds_busy: dict[str, tuple[int, float]] = {}  # seed address -> (times it said busy, retry at)
        self.started = time.monotonic()
        self.boot = os.urandom(8)  # tells peers a restarted node from a second connection of this one
        self._dialing: set[str] = set()
        self._reaching: dict[str, asyncio.Task] = {}  # node id -> the dial that reach() waits on
        self._reached: set[Connection] = set()  # connections reach() dialled, closed again when idle
        # peers that components (the averager) will exchange with soon: their connections stay open
        self.keep: list[Callable[[], set[str]]] = []
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self._stopped = asyncio.Event()
        self._membership_changed = asyncio.Event()  # a peer connected or left: gossip soon
        self._ssl_server, self._ssl_client = ssl_contexts(cfg)
        self.state_file = Path(f"{cfg.identity}.peers.json")
        # what a node does besides membership (training, serving) plugs in here
        self.handlers: dict[str, Callable[[Connection, Message], Awaitable[None]]] = {  # by message type
            "ping": self._on_ping, "pong": self._on_pong, "peers": self._on_peers, "status": self._on_status,
            "probe": self._on_probe, "bye": self._on_bye, "error": self._on_error}
        # by message type: (peer, the message's fields but its inline tensor, that tensor's dtype and
        # bytes) -> a tensor of this node's own to read the inline tensor straight into, or None
        self.lenders: dict[str, Callable[[str, dict, str, int], torch.Tensor | None]] = {}
        self.peer_hooks: list[Callable[[Connection], Awaitable[None]]] = []  # run when a peer registers
        # the parts of its status that what it does adds, by name ("serving", "training": NodeStatus's fields)
        self.status_parts: dict[str, Callable[[], ServingStatus | TrainingStatus]] = {}
        self.line_parts: list[Callable[[], str]] = []  # extra fields of the status line
        self.serving_model = ""  # id of the model whose blocks it serves (set by a serving component)

    # --- life cycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        host, port = parse_addr(self.cfg.listen)
        # a deep accept queue: connections beyond it wait in the kernel, unseen by the handshake
        # limits and deadline, and reach the node seconds later (SYN-ACK retries)
        self._server = await listen(host, port, self._inbound, self._ssl_server, backlog=1024,
                                    timeout=self.cfg.handshake_timeout)
        log.info("node %s listening on %s (swarm %s, role %s%s)", self.id[:8], self.cfg.listen, self.cfg.swarm,
                 self.cfg.role, ", authenticated" if self.secret else "")
        for loop in (self._ping_loop, self._gossip_loop, self._seed_loop, self._status_loop):
            self.spawn(self._supervised(loop))

    async def _supervised(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run one of the node's background loops for as long as the node runs. An error that escapes
        it (a bug, or a peer's input that got past the checks) is logged and the loop starts again
        after a pause, rather than the node going on without it: no more gossip, pings or status."""
        while True:
            try:
                return await loop()
            except Exception:
                log.exception("the node's %s failed; it starts again in %g s (please report this)",
                              loop.__name__.strip("_").removesuffix("_loop"), LOOP_RESTART_S)
                await asyncio.sleep(LOOP_RESTART_S)

    async def run(self, work: Callable[[], Awaitable[None]] | None = None) -> None:
        """Start, run `work` (training) beside the server, serve until SIGINT/SIGTERM, shut down cleanly.

        If `work` fails, the node stops and the error is raised.
        """
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stopped.set)
        await self.start()
        failures: list[BaseException] = []
        if work is not None:
            def finished(task: asyncio.Task) -> None:
                if not task.cancelled() and task.exception() is not None:
                    failures.append(task.exception())
                    self._stopped.set()

            self.spawn(work()).add_done_callback(finished)
        await self._stopped.wait()
        await self.stop()
        if failures:
            raise failures[0]

    async def stop(self) -> None:
        """Say goodbye to every peer, close everything, write the peer table."""
        log.info("node %s stopping", self.id[:8])
        if self._server:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for conn in list(self.conns.values()):
            await self._say_bye(conn, "shutdown")
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.write_state()
        self.identity.release()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- connections ------------------------------------------------------------------------------

    def _inbound(self) -> Connection:
        """The connection of a socket the server accepted; `_on_inbound` takes it once it is open."""
        return Connection(self.traffic, self._session(dialler=False), self.cfg.timeout,
                          opened=lambda conn: self.spawn(self._on_inbound(conn)))

    async def _on_inbound(self, conn: Connection) -> None:
        host = conn.host
        total = sum(self.unauthenticated.values())
        if total >= self.cfg.max_unauthenticated or self.unauthenticated[host] >= self.cfg.max_unauthenticated_per_host:
            self.quiet.log(logging.WARNING, "busy", "refused a connection from %s: %d connections (%d from there) "
                           "are still in their handshake", host, total, self.unauthenticated[host])
            busy = Error(id=1, code="busy", message="too many connections in their handshake; try again later")
            conn.transport.write(encode(busy.to_wire()))
            await conn.close()
            return
        await self._admit(conn)

    def _session(self, dialler: bool) -> Session:
        me = {"node": self.id, "addr": self.cfg.address, "role": self.cfg.role, "blocks": list(self.cfg.blocks),
              "serves": list(self.cfg.serves), "model": self.serving_model, "boot": self.boot}
        return open_session(me, self.cfg, self.secret, dialler, self.budget, self.frames, self._lend)

    def _lend(self, peer: str, fields: dict, dtype: str, nbytes: int) -> memoryview | None:
        """Where a message's inline tensor is read as it arrives, if a component has a place for it
        (the session's `Lender`)."""
        lender = self.lenders.get(fields["t"])
        into = lender(peer, fields, dtype, nbytes) if lender is not None else None
        if into is None:
            return None
        if DTYPE_NAMES[into.dtype] != dtype or into.numel() * into.element_size() != nbytes:
            raise ValueError(f"a place for a {fields['t']} message's tensor must be {nbytes} bytes of {dtype}")
        return as_view(into)

    async def dial(self, addr: str) -> Connection | None:
        """Connect to addr and run the handshake; None (and a log line) if that fails."""
        if addr in self._dialing or addr == self.cfg.address:
            return None
        self._dialing.add(addr)
        try:
            host, port = parse_addr(addr)
            conn = await dial(host, port, self.traffic, self._session(dialler=True), self.cfg.timeout, self._ssl_client)
        except (OSError, TimeoutError, ssl.SSLError, ValueError) as exc:
            # a seed the user gave, failing for a while (not a swarm's members starting together): a
            # typo would otherwise leave the node alone without a word; TLS that fails is no passing state
            failing = self._seeds_failing.setdefault(addr, time.monotonic()) if addr in self.cfg.peers else None
            if isinstance(exc, TlsFailed):
                self.quiet.log(logging.WARNING, "tls", "cannot dial %s: %s", addr, exc)
            elif failing is not None and time.monotonic() - failing >= SEED_WARN_S:
                self.quiet.log(logging.WARNING, f"seed {addr}", "cannot reach --peer %s: %s", addr,
                               str(exc) or type(exc).__name__)
            else:
                log.debug("cannot reach %s: %r", addr, exc)
            self._dialing.discard(addr)
            return None
        self._seeds_failing.pop(addr, None)
        conn.dialled = addr
        admitted = asyncio.get_running_loop().create_future()
        self.spawn(self._admit(conn, admitted))
        try:
            return conn if await admitted else None
        finally:
            self._dialing.discard(addr)

    async def reach(self, node: str) -> Connection | None:
        """A connection to a peer: the open one, or one dialled at the address gossip gave for it (a
        node can average with more peers than it keeps connected); None if neither works."""
        conn = self.conns.get(node)
        if (conn is None or conn.closed) and node in self.known and self.known[node].addr:
            if node not in self._reaching:  # (one dial for all the sends waiting on it)
                self._reaching[node] = self.spawn(self.dial(self.known[node].addr))
                self._reaching[node].add_done_callback(lambda _: self._reaching.pop(node, None))
            conn = await asyncio.shield(self._reaching[node])
            if conn is not None and conn.label == node and not conn.closed:
                self._reached.add(conn)
            elif conn is None:  # (it dialled this node at the same time, or gossip was dialling it: either won)
                conn = self.conns.get(node) or await self._dialled_by_gossip(node)
        return conn if conn is not None and conn.label == node and not conn.closed else None

    async def _dialled_by_gossip(self, node: str) -> Connection | None:
        """The connection a dial already under way (by gossip) makes to a peer, within the timeout."""
        addr = self.known[node].addr if node in self.known else None
        deadline = time.monotonic() + self.cfg.timeout
        while addr in self._dialing and node not in self.conns and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.conns.get(node)

    async def _admit(self, conn: Connection, admitted: asyncio.Future | None = None) -> None:
        """Handshake (within the deadline), register, then serve the connection until it ends."""
        hello = await self._admitted_hello(conn)
        if hello is not None and hello.role != "client" and not self._room_for_peer(conn):
            if admitted is not None:
                admitted.set_result(False)
            with contextlib.suppress(PeerGone):  # (others it may join through: a newcomer would know no one else)
                await conn.send(Error(code="busy", message="too many peers connected; try again later",
                                      peers=self._peer_sample()))
            await conn.close()
            return
        kept = hello is not None and (hello.role == "client" or self._register(conn, hello))
        if admitted is not None:
            admitted.set_result(kept)
        if not kept:
            await conn.close()
            return
        if hello.role == "client":
            from_there = sum(c.host == conn.host for c in self.clients)
            if len(self.clients) >= self.cfg.max_clients or from_there >= self.cfg.max_clients_per_host:
                self.quiet.log(logging.WARNING, "clients", "refused a client from %s: %d clients (%d from there)",
                               conn.host, len(self.clients), from_there)
                await conn.refuse(ProtocolError("busy", "too many clients connected; try again later"))
                return
            self.traffic.relabel(conn.label, CLIENTS)
            conn.label = CLIENTS
            self.clients.add(conn)
        await conn.serve(self._handle, self.cfg.dead_after)
        self.clients.discard(conn)
        self._reached.discard(conn)
        if self.conns.get(conn.label) is conn:
            del self.conns[conn.label]
            self._membership_changed.set()
            self.membership_log.log(logging.INFO, "disconnected", "peer %s (%s) disconnected", conn.label[:8],
                                    hello.addr)

    async def _admitted_hello(self, conn: Connection) -> Hello | None:
        """The peer's hello once the handshake is through, or None (refused, failed, too slow); it
        counts as a connection in its handshake meanwhile."""
        self.unauthenticated[conn.host] += 1
        try:
            return await asyncio.wait_for(self._handshake(conn), self.cfg.handshake_timeout)
        except ProtocolError as exc:
            self.quiet.log(logging.WARNING, "refused", "refused %s: %s", conn.remote,
                           handshake_failure(exc, "the peer", "this node", self.secret is not None))
            await conn.refuse(exc)
        except (PeerGone, TimeoutError) as exc:
            # (a swarm secret or TLS that does not match will not pass by itself: said louder)
            mistake = isinstance(exc, PeerRefused) and exc.code in ("auth_required", "auth_failed", "tls_required")
            self.quiet.log(logging.WARNING if mistake else logging.INFO, "handshake", "handshake with %s failed: %s",
                           conn.remote, handshake_failure(exc, "the peer", "this node", self.secret is not None)
                           if mistake else exc or f"not done within {self.cfg.handshake_timeout:.0f}s")
        finally:
            self.unauthenticated[conn.host] -= 1
            if self.unauthenticated[conn.host] <= 0:
                del self.unauthenticated[conn.host]
        return None

    async def _handshake(self, conn: Connection) -> Hello:
        hello = await conn.open()
        existing = self.conns.get(hello.node)
        if existing is not None and not existing.closed and existing.hello.addr != hello.addr:
            raise ProtocolError("duplicate_identity", f"node {hello.node[:8]} is already connected from "
                                                      f"{existing.hello.addr}")
        return hello

    def _room_for_peer(self, conn: Connection) -> bool:
        """Whether a peer that dialled in may stay: at most max_inbound_peers such connections, and
        max_inbound_peers_per_host from one address. Without a swarm secret anyone can make up node
        ids, and each would otherwise hold a connection (and its pings and gossip) for good. A peer
        replacing its own connection (a restart, both sides dialling at once) always may."""
        if conn.outbound or conn.label in self.conns:
            return True
        inbound = [c for c in self.conns.values() if not c.outbound and not c.closed]
        from_there = sum(c.host == conn.host for c in inbound)
        if len(inbound) < self.cfg.max_inbound_peers and from_there < self.cfg.max_inbound_peers_per_host:
            return True
        self.quiet.log(logging.WARNING, "peers", "refused a peer from %s: %d peers dialled in (%d from there)",
                       conn.host, len(inbound), from_there)
        return False

    def _register(self, conn: Connection, hello: Hello) -> bool:
        """Make conn the connection to its peer; False if an equivalent one is kept instead.

        A second connection to the same peer comes from a restart (another boot id: the old one is
        stale and goes) or from both sides dialling at once (same boot id: both sides keep the one
        dialled by the smaller node id, so they agree without a word).
        """
        existing = self.conns.get(conn.label)
        if existing is not None and not existing.closed and existing.hello.boot == hello.boot:
            initiator = self.id if conn.outbound else conn.label
            if initiator != min(self.id, conn.label):
                log.debug("duplicate connection to %s; keeping the other one", conn.label[:8])
                return False
        self.conns[conn.label] = conn
        self._membership_changed.set()
        if existing is not None and existing is not conn:
            self.spawn(existing.close())
        info = self.known.get(conn.label)
        if info is None:
            self.membership_log.log(logging.INFO, "joined", "peer %s joined from %s (role %s, blocks %s)",
                                    conn.label[:8], hello.addr, hello.role, hello.blocks)
        self.known[conn.label] = PeerInfo(conn.label, hello.addr, hello.role, hello.blocks, list(hello.serves or []),
                                          rtt_ms=info.rtt_ms if info else None, failures=info.failures if info else 0,
                                          retry_at=info.retry_at if info else 0.0)  # (a full peer stays backed off)
        for hook in self.peer_hooks:
            self.spawn(hook(conn))
        return True

    # --- messages ---------------------------------------------------------------------------------

    async def _handle(self, conn: Connection, msg: Message) -> None:
        """Route a message by its type to the one handler registered for it."""
        handler = self.handlers.get(msg.t)
        if handler is None and msg.t in SERVING_REQUESTS:  # (a client asked the wrong node: it may ask another)
            text = f"this node serves no blocks: send {msg.t} to a node started with --serve A-B --checkpoint DIR"
            await conn.send(Error(re=msg.id, code="no_route", message=text))
            return
        if handler is None and msg.re is not None and msg.t in REPLIES.values():
            log.debug("%s answering a request no longer waited for (timed out) from %s", msg.t, conn.label[:8])
            return
        if handler is None:
            raise ProtocolError("unexpected", f"a node does not accept {msg.t} here")
        await handler(conn, msg)

    async def _on_ping(self, conn: Connection, msg: Message) -> None:
        await conn.send(Pong(re=msg.id, ts=msg.ts))

    async def _on_pong(self, conn: Connection, msg: Message) -> None:
        info = self.known.get(conn.label)
        if info:
            info.rtt_ms = (time.monotonic() - msg.ts) * 1000
            info.last_seen = time.monotonic()
            info.failures, info.retry_at = 0, 0.0  # (reachable after all: no back-off when it next goes)
        self._seeds_busy.pop(conn.dialled, None)

    async def _on_probe(self, conn: Connection, msg: Message) -> None:
        elements = sum(t.numel() for t in msg.tensors)
        nbytes = sum(t.numel() * t.element_size() for t in msg.tensors)
        await conn.send(ProbeReply(re=msg.id, elements=elements, bytes=nbytes))

    async def _on_bye(self, conn: Connection, msg: Message) -> None:
        raise PeerGone(f"{conn.label[:8]} said goodbye ({msg.reason})")

    async def _on_error(self, conn: Connection, msg: Message) -> None:
        if msg.re is not None:  # (an answer to a request no longer waited for: it timed out)
            log.debug("error %s from %s answering a request no longer waited for", msg.code, conn.label[:8])
            return
        if msg.code == "busy":  # full: dial it again later, not at the next gossip (its leaving brings one at once)
            if (info := self.known.get(conn.label)) is not None:
                self._back_off(info)
            if conn.dialled in self.cfg.peers:
                times, _ = self._seeds_busy.get(conn.dialled, (0, 0.0))
                self._seeds_busy[conn.dialled] = times + 1, time.monotonic() + backoff(self.cfg.seed_interval, times)
            self._learn_all(msg.peers or [], "busy")  # (the others it named: a way in)
        raise PeerGone(f"{conn.label[:8]} reported {msg.code}: {msg.message}")

    # --- loops ------------------------------------------------------------------------------------

    async def _ping_loop(self) -> None:
        """Ping connections so that each side hears the other while a long request runs (a client
        answers with pong: PROTOCOL.md, section 5). Between peers the side that dialled pings and the
        other answers, so each hears the other every interval (in a swarm that averages rarely,
        pings in both directions were a good share of the bytes moved). The other side pings too
        when it has heard or said nothing for longer than that (its peer's pings, or its own pongs,
        are stuck behind a large transfer), when it has no RTT for the peer yet, and every RTT_EVERY
        intervals for its RTT."""
        loop = asyncio.get_running_loop()
        for beat in itertools.count(1):
            await asyncio.sleep(self.cfg.ping_interval)
            quiet = loop.time() - 1.5 * self.cfg.ping_interval
            for conn in [*self.conns.values(), *self.clients]:
                info = self.known.get(conn.label)
                if conn not in self._pinging and (
                        conn.outbound or conn in self.clients or min(conn.heard, conn.said) < quiet
                        or info is None or info.rtt_ms is None or beat % RTT_EVERY == 0):
                    self._pinging.add(conn)  # (each on its own: a peer that stops reading delays no other)
                    self.spawn(self._ping(conn))
                if conn.stream_stalled(loop.time()):
                    self.spawn(conn.refuse(ProtocolError("stalled", f"a stream had no frame, or no message naming it, "
                                                                    f"for {STALLED_TIMEOUTS} x {conn.timeout:g}s")))
            self.close_idle(time.monotonic())

    async def _ping(self, conn: Connection) -> None:
        """One ping at a time per connection: pings behind a long send would go out in a burst, and
        their RTTs would time the send."""
        try:
            with contextlib.suppress(PeerGone):
                await conn.send(Ping(ts=time.monotonic()))
        finally:
            self._pinging.discard(conn)

    def close_idle(self, now: float) -> None:
        """Close the connections reach() dialled that carried nothing but pings for reach_idle, the
        longest idle first, while the node holds more than max_peers: averaging in a large group
        reaches new peers round after round, and they would otherwise all stay open. Connections to
        the peers a component keeps (the averager: its row and column, this round and the next)
        stay open, however long training takes between rounds."""
        self._reached = {c for c in self._reached if not c.closed}
        keep = set().union(*(partners() for partners in self.keep))
        idle = sorted((c for c in self._reached if self.conns.get(c.label) is c and c.label not in keep
                       and now - c.used > self.cfg.reach_idle), key=lambda c: c.used)
        for conn in idle[: max(0, len(self.conns) - self.cfg.max_peers)]:
            log.debug("closing the idle connection to %s (reached for averaging)", conn.label[:8])
            self._reached.discard(conn)
            self.spawn(self._say_bye(conn, "idle"))

    async def _say_bye(self, conn: Connection, reason: str) -> None:
        with contextlib.suppress(PeerGone):
            await conn.send(Bye(reason=reason))
        await conn.close()

    # --- status -----------------------------------------------------------------------------------
