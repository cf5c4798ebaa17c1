"""A node that serves consecutive blocks for inference, and coordinates the requests of clients.

A client sends `generate` or `score` to any serving node, which becomes the request's coordinator:
it picks a route (spheroid/pipeline.py) and, for every traversal, sends a `hop` to the route's
first node. Each node on the route runs the Euler steps of its blocks (in a worker thread, so the
event loop, and a training loop beside it, keep going; the hops of concurrent sessions that arrive
while a batch runs make the next batch, packed into one sequence per layer call: `Batcher`) and
streams the noisy tensor to the next;
the first node draws the starting noise itself, the last one reads off the logits and sends the
bytes (or, for scoring, the summed negative log-likelihood) to the coordinator in `hop_done`.
Activations move node to node and never through the client or the coordinator. With the relay
channel a hop also carries its last block's clean stream over the context, which the next node's
first block starts from: per session each node keeps what it was sent, so after a session's first
traversal only the new positions travel.

A hop that fails reports `hop_error` naming the node it could not reach; a traversal that gets no
answer within `hop_timeout` is retried on a route without the nodes that are gone or do not answer
a ping; after `retries` failed attempts the client gets a clear error. A node that refused a hop
only because it was busy (`Busy`) is routed around if another node serves its blocks, else asked
again after pauses that last at most `hop_timeout` in all. Nothing waits without a timeout.

Noise and sampling use generators derived from the seed and each byte's index
(chain.traversal_generators; a generation hop's `traversal` is the index of its first byte), so a
pipeline produces the bytes `spheroid generate CKPT` produces locally for the same seed, in every
mode. Mode `spec` (speculative decoding) checks bytes drafted by prompt lookup in the same
traversal as the next one (chain.next_traversal): the last node keeps them by the
speculative-sampling rule (chain.accept_draft), so the output is distributed as `ar`'s, and is
`ar`'s very bytes at temperature 0.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import math
import os
import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as fn

from .. import checkpoint
from ..chain import DEFAULT_DRAFT, accept_draft, euler_steps, next_traversal, sample_bytes, starting_noise, window_start
from ..config import RunConfig
from ..loading import block_from, load_reference
from ..model import CleanStream, KVCache, Span, make_codebook, packed_causal, packed_kv
from ..noise import sigma_grid
from ..pipeline import Hop, NoRoute, build_route, check_route, serving_range
from ..progress import QuietLog
from ..wire import ProtocolError, messages
from .connection import Connection, PeerGone
from .node import CLIENTS, Node

log = logging.getLogger(__name__)
QUIET = QuietLog(log)  # (failures a request can repeat)

MAX_PROMPT = 1 << 16  # bytes of prompt a request may carry
MAX_GENERATE = 1 << 16  # bytes one request may ask for
MAX_TEXT = 1 << 20  # bytes of text one score request may carry
MAX_OFFSET = 1 << 48  # where that text may start in a longer one (score.offset)
MAX_SEED = (1 << 63) - 1  # seeds are torch generator seeds: signed 64-bit
MAX_REQUESTS = 8  # a client connection's requests in flight at one coordinator (score_text sends 4 at once)
BUSY_PAUSE_S = 0.05  # a coordinator's first pause before asking a busy node again (then doubling)


def check_seed(msg: messages.Message) -> None:
    if msg.seed > MAX_SEED:
        raise ValueError(f"seed must be at most 2^63 - 1, got {msg.seed}")


def check_temperature(msg: messages.Message) -> None:
    if not math.isfinite(msg.temperature) or msg.temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0, got {msg.temperature}")


class HopFailed(Exception):
    """A traversal failed at `node`; `stale`: only because that node no longer held the session (it
    was evicted from its cache), `busy`: only because too many hops waited there; either way the
    node itself is fine."""

    def __init__(self, node: str, message: str, stale: bool = False, busy: bool = False) -> None:
        super().__init__(message)
        self.node, self.stale, self.busy = node, stale, busy


class StaleSession(ValueError):
    """A hop assumes session state this node no longer holds (evicted, or expired): the traversal
    must start over on a new session."""


class Busy(ValueError):
    """Too many hops wait at this node already: the traversal may be asked again in a moment."""


@dataclass
class Session:
    """What a serving node keeps of one session between traversals: its caches (a clean stream per
    block, or keys and values per layer), and the bytes they were computed from."""

    make: Callable[[], list[CleanStream] | list[KVCache]]
    caches: list = field(default_factory=list)
    tokens: bytes = b""
    used: float = field(default_factory=time.monotonic)
    relayed: tuple[str, int] = ("", 0)  # (next hop, positions of the relayed clean stream it holds)

    def __post_init__(self) -> None:
        self.caches = self.caches or self.make()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def reset(self) -> None:
        self.caches, self.tokens, self.relayed = self.make(), b"", ("", 0)

    def keep(self, ctx: bytes) -> None:
        """Hold the caches for ctx: keep the positions ctx shares with the bytes they were computed from
        (each position depends only on those before it) and drop the rest, e.g. refused drafts."""
        shared = min(len(self.tokens), len(ctx))
        same = next((i for i in range(shared) if self.tokens[i] != ctx[i]), shared)
        if same < len(self.tokens):
            for cache in self.caches:
                cache.truncate(same)
            self.relayed = (self.relayed[0], min(self.relayed[1], same))
        self.tokens = ctx


class SessionCache:
    """Sessions of a serving node, bounded and expiring.

    Least recently used sessions go first when the bytes held pass `max_bytes`; a session unused
    for `ttl` seconds is dropped at the next access.
    """

    def __init__(self, max_bytes: int, ttl: float) -> None:
        self.max_bytes, self.ttl = max_bytes, ttl
        self._sessions: dict[str, Session] = {}
        # hops of different sessions run in worker threads at once, and the status reads it too
        self._lock = threading.RLock()

    def get(self, session: str, make: Callable[[], list]) -> Session:
        """The session's state; a new one holds the caches `make` returns."""
        with self._lock:
            now = time.monotonic()
            for key in [k for k, s in self._sessions.items() if now - s.used > self.ttl]:
                del self._sessions[key]
            found = self._sessions.pop(session, None) or Session(make)
            found.used = now
            self._sessions[session] = found  # most recently used last
            while self.nbytes > self.max_bytes and len(self._sessions) > 1:
                del self._sessions[next(iter(self._sessions))]
            return found

    def drop(self, session: str) -> None:
        with self._lock:
            self._sessions.pop(session, None)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._sessions.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)


@dataclass
class Prepared:
    """A BlockTrain hop checked and ready for this node's steps: its span, starting z (1, n, d), the
    session's clean streams (block index -> stream) and the session (None when scoring)."""

    span: Span
    z: torch.Tensor
    streams: dict[int, CleanStream]
    session: Session | None


def _catch(work: Callable, *args: object) -> object:
    """work(*args), or the exception it raised: one hop's failure refuses that hop, not its batch."""
    try:
        return work(*args)
    except Exception as exc:  # noqa: BLE001 - whatever it was, the other hops of the batch go on
        if not isinstance(exc, ValueError):
            QUIET.log(logging.ERROR, "read-off", "a hop's read-off failed", exc_info=True)
        return exc


class Allowance:
    """At most `count` events in any `period` seconds: bounds what peers' messages can make a node do."""

    def __init__(self, count: int, period: float) -> None:
        self.count, self.period = count, period
        self.times: collections.deque[float] = collections.deque()

    def allow(self) -> bool:
        now = time.monotonic()
        while self.times and now - self.times[0] > self.period:
            self.times.popleft()
        if len(self.times) >= self.count:
            return False
        self.times.append(now)
        return True


class Batcher:
    """Runs a node's hops in one worker thread, a batch at a time: each batch takes every hop that
    arrived while the previous one ran (one per session, at most `max_hops` and `max_positions`
    positions in all, since a packed batch's attention mask grows with the square of its positions),
    so concurrent sessions share each layer call instead of taking turns (continuous batching). An
    idle node runs a hop at once, alone, so one session waits for nothing.

    `compute` maps a list of hops to a list of results, an exception standing for a refused hop.
    At most `max_queued` hops wait (each holds its tensor): one more is refused as busy, and its
    coordinator routes around this node or asks again after a moment, rather than the node growing
    without bound under peers that send hops faster than they run.
    """

    def __init__(self, compute: Callable[[list], list], spawn: Callable, counters: dict, max_hops: int = 32,
                 max_positions: int = 2048, max_queued: int = 128) -> None:
        self.compute, self.spawn, self.counters = compute, spawn, counters
        self.max_hops, self.max_positions, self.max_queued = max_hops, max_positions, max_queued
        self.queue: list[tuple[object, str, int, asyncio.Future]] = []
        self.busy = False

    async def run(self, hop: object, session: str, positions: int) -> object:
        """The result of `hop` (of `session`, over about `positions` positions) once its batch has run;
        raises what refused it (Busy when `max_queued` hops wait already)."""
        if len(self.queue) >= self.max_queued:
            raise Busy(f"busy: {len(self.queue)} hops wait here already")
        future = asyncio.get_running_loop().create_future()
        self.queue.append((hop, session, positions, future))
        if not self.busy:
            self.busy = True
            self.spawn(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self.queue:
                batch, sessions, positions, later = [], set(), 0, []
                for item in self.queue:  # a session's hops stay in order, one per batch
                    fits = not batch or (len(batch) < self.max_hops and positions + item[2] <= self.max_positions)
                    if fits and item[1] not in sessions:
                        batch.append(item)
                        sessions.add(item[1])
                        positions += item[2]
                    else:
                        later.append(item)
                self.queue = later
                try:
                    results = await asyncio.to_thread(self.compute, [hop for hop, _, _, _ in batch])
                except Exception as exc:  # noqa: BLE001 - whatever failed, every hop of the batch hears it
                    results = [exc] * len(batch)
                self.counters["batches"] += 1
                for (_, _, _, future), result in zip(batch, results, strict=True):
                    if future.done():  # its hop was cancelled
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self.busy = False


class PipelineServer(ABC):
    """What every serving node does: coordinate client requests along routes, and relay hops.

    Subclasses say what a batch of hops computes (`_compute_batch`) and what a request is (`_generate`, `_score`).
    """

    kind = ""

    def __init__(self, node: Node, cfg: RunConfig, first: int, last: int, model_id: str, hop_timeout: float,
                 retries: int, cache_mb: float, session_ttl: float, max_queued: int) -> None:
        if last >= cfg.model.n_blocks:
            raise ValueError(f"--serve {first}-{last}: the model has blocks 0..{cfg.model.n_blocks - 1}")
        self.node, self.cfg, self.first, self.last = node, cfg, first, last
        self.device = torch.device("cpu")
        self.model_id = model_id
        node.serving_model = model_id
        self.hop_timeout, self.retries = hop_timeout, retries
        self.sessions = SessionCache(int(cache_mb * 2**20), session_ttl)
        # (session, traversal) -> the answer awaited, and the route whose nodes may give it
        self.waiting: dict[tuple[str, int], tuple[asyncio.Future, list[Hop]]] = {}
        self.requests: collections.Counter[Connection] = collections.Counter()  # client requests running, by connection
        self.counters = {"hops": 0, "requests": 0, "traversals": 0, "failed_hops": 0, "reroutes": 0,
                         "busy_waits": 0, "relayed_rows": 0, "batches": 0}
        self.batcher = Batcher(self._compute_batch, node.spawn, self.counters, max_queued=max_queued)
        self._learned = Allowance(8, 60.0)  # nodes learned from hops' routes (see _connection)
        node.handlers.update(hop=self.on_hop, hop_done=self.on_hop_done, hop_error=self.on_hop_error,
                             generate=self.on_generate, score=self.on_score)
        node.status_parts["serving"] = self.status

    def status(self) -> dict:
        return {"blocks": [self.first, self.last], "n_blocks": self.cfg.model.n_blocks, "kind": self.kind,
                "context": self.cfg.model.context, "model": self.model_id, "sessions": len(self.sessions),
                "cache_bytes": self.sessions.nbytes, **self.counters}

    # --- routes -------------------------------------------------------------------------------------

    def candidates(self) -> list[Hop]:
        """This node and every connected member that serves a consecutive range of blocks of this model."""
        out = [Hop(self.node.id, self.node.cfg.address, self.first, self.last, 0.0)]
        for node_id, conn in self.node.conns.items():
            rng = serving_range(conn.hello.serves or [])
            info = self.node.known.get(node_id)
            if rng is not None and not conn.closed and conn.hello.model == self.model_id:
                out.append(Hop(node_id, conn.hello.addr, *rng, info.rtt_ms if info else None))
        return out

    def route(self, requested: list, exclude: set[str]) -> list[Hop]:
        """The client's route if it named one (and none of it failed), else the best one from membership."""
        if requested and not exclude:
            route = [Hop.from_wire(h) for h in requested]
            check_route(route, self.cfg.model.n_blocks)
            return route
        return build_route(self.candidates(), self.cfg.model.n_blocks, exclude)

    # --- coordinating ---------------------------------------------------------------------------------

    async def on_generate(self, conn: Connection, msg: messages.Message) -> None:
        await self._start(conn, msg, self._generate)

    async def on_score(self, conn: Connection, msg: messages.Message) -> None:
        await self._start(conn, msg, self._score)

    async def _start(self, conn: Connection, msg: messages.Message, work: Callable) -> None:
        """Run a client request in the background, unless its connection has MAX_REQUESTS running:
        one client cannot fill the nodes' hop queues for everyone."""
        if self.requests[conn] >= MAX_REQUESTS:
            await conn.send(messages.Error(re=msg.id, code="busy", message=f"at most {MAX_REQUESTS} requests at "
                                           "once per connection: wait for one to finish"))
            return
        self.requests[conn] += 1
        self.node.spawn(self._answer(conn, msg, work(conn, msg)))

    async def _answer(self, conn: Connection, msg: messages.Message, work) -> None:
        """Run a client request; any failure becomes one clear error reply, and the node carries on."""
        self.counters["requests"] += 1
        try:
            await work
        except PeerGone:
            self.node.quiet.log(logging.INFO, "client gone", "client of request %d went away", msg.id)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the client hears it and the node goes on
            if isinstance(exc, (NoRoute, HopFailed, ValueError)):
                code = {NoRoute: "no_route", HopFailed: "hop_failed"}.get(type(exc), "bad_request")
            else:
                self.node.quiet.log(logging.ERROR, "failed request", "request %d failed", msg.id, exc_info=True)
                code = "internal"
            with contextlib.suppress(PeerGone):
                await conn.send(messages.Error(re=msg.id, code=code, message=str(exc)))
        finally:
            self.requests[conn] -= 1
            if not self.requests[conn]:
                del self.requests[conn]

    async def traverse(self, traversal: int, requested: list, exclude: set[str], fields: dict,
                       retry_fields: Callable[[], dict] | None = None) -> tuple[messages.Message, list[Hop]]:
        """One traversal of the route; re-routed around failed nodes, at most `retries` times.

        `fields` (with the session) make the hop; `retry_fields` makes the hop of a retry, on a new
        session: the nodes' session state cannot be trusted after a failure. A node that failed
        only because it no longer held the session (`stale`) is not routed around.
        """
        me = [self.node.id, self.node.cfg.address, 0, 0]
        error, attempt, waits, busy_until, renew = "no attempt", 0, 0, None, False
        while attempt <= self.retries:
            if renew and retry_fields is not None:
                fields = retry_fields()
            renew = True  # (unless the failure below says no node did any work)
            try:
                route = self.route(requested, exclude)
            except NoRoute as exc:
                if not exclude:
                    raise
                raise HopFailed("", f"{error}; and no route without the nodes that failed: {exc}") from None
            key = (fields["session"], traversal)
            future = asyncio.get_running_loop().create_future()
            self.waiting[key] = future, route
            hop = messages.Hop(traversal=traversal, route=[h.to_wire() for h in route], at=0, coordinator=me,
                               model=self.model_id, **fields)
            try:
                await self._deliver(route[0], hop)
                done = await asyncio.wait_for(future, self.hop_timeout)
                self.counters["traversals"] += 1
                return done, route
            except HopFailed as exc:
                error = str(exc)
                if exc.busy:  # (no attempt spent: routing around leaves fewer nodes, and the pauses have a bound)
                    if self._avoidable(requested, exclude, exc.node):
                        exclude.add(exc.node)
                        continue
                    # the only node for its blocks: asked again after a pause (doubling, jittered so that
                    # coordinators refused together do not come back together), all pauses within hop_timeout
                    busy_until = busy_until or time.monotonic() + self.hop_timeout
                    pause = min(BUSY_PAUSE_S * 2**waits * random.uniform(0.5, 1.5), busy_until - time.monotonic())
                    if pause > 0:
                        self.counters["busy_waits"] += 1
                        waits += 1
                        renew = exc.node != route[0].node  # (refused by the first node: nothing was computed)
                        await asyncio.sleep(pause)
                        continue
                if not exc.stale:
                    exclude.add(exc.node)
            except (TimeoutError, PeerGone) as exc:
                error = f"no answer from the route within {self.hop_timeout}s" if isinstance(exc, TimeoutError) \
                    else str(exc)
                exclude.update(await self._unresponsive(route))
            finally:
                self.waiting.pop(key, None)
            self.counters["reroutes"] += 1
            self.node.quiet.log(logging.WARNING, "failed traversal", "traversal %d of session %s failed (attempt "
                                "%d): %s", traversal, fields["session"], attempt + 1, error)
            attempt += 1
        raise HopFailed("", f"the request failed after {self.retries + 1} attempts: {error}")

    def _avoidable(self, requested: list, exclude: set[str], node: str) -> bool:
        """Whether a route without `node` (and the nodes already excluded) exists."""
        try:
            self.route(requested, exclude | {node})
        except NoRoute:
            return False
        return True

    async def _unresponsive(self, route: list[Hop]) -> set[str]:
        """The route's nodes that are gone or do not answer a ping within a couple of seconds (hung)."""
        async def alive(hop: Hop) -> bool:
            if hop.node == self.node.id:
                return True
            conn = self.node.conns.get(hop.node)
            if conn is None or conn.closed:
                return False
            try:
                await conn.request(messages.Ping(ts=time.monotonic()), timeout=min(2.0, self.hop_timeout))
            except PeerGone:
                return False
            return True

        answers = await asyncio.gather(*(alive(h) for h in route))
        return {h.node for h, ok in zip(route, answers, strict=True) if not ok}

    def _awaited(self, conn: Connection | None, msg: messages.Message, last: bool) -> asyncio.Future | None:
        """The traversal's future, if `msg` may answer it: it comes from the route's last node (a
        `hop_done`) or from one of its nodes (a `hop_error`); `conn` None: from this node itself."""
        future, route = self.waiting.get((msg.session, msg.traversal), (None, []))
        sender = self.node.id if conn is None else conn.label
        if future is None or future.done() or sender not in ({route[-1].node} if last else {h.node for h in route}):
            return None
        return future

    async def on_hop_done(self, conn: Connection | None, msg: messages.Message) -> None:
        if (future := self._awaited(conn, msg, last=True)) is not None:
            future.set_result(msg)

    async def on_hop_error(self, conn: Connection | None, msg: messages.Message) -> None:
        if (future := self._awaited(conn, msg, last=False)) is not None:
            future.set_exception(HopFailed(msg.node, f"hop {msg.node[:8]}: {msg.message}", bool(msg.stale),
                                           bool(msg.busy)))

    # --- hops ---------------------------------------------------------------------------------------

    async def _connection(self, hop: Hop) -> Connection:
        """The connection to a route's node or a coordinator: the open one, or one dialled at the address
        membership knows for it (`Node.reach`). The address a hop gives counts only for a node this
        one has not heard of yet (a coordinator can route through a node that joined since this
        node last gossiped): it is learned as gossip would learn it, a few a minute at most, and
        never replaces a known address, so hops make a node dial no more than gossip can."""
        known = hop.node in self.node.known or hop.node in self.node.conns
        if not known and hop.addr and self._learned.allow():
            self.node.learn({"node": hop.node, "addr": hop.addr, "role": "server", "blocks": [],
                             "serves": list(range(hop.first, hop.last + 1))}, time.monotonic())
        conn = await self.node.reach(hop.node)
        if conn is None:
            raise PeerGone(f"cannot reach {hop.node[:8]} at {hop.addr}")
        return conn

    async def _deliver(self, hop: Hop, msg: messages.Message, z: torch.Tensor | None = None) -> None:
        """Hand a hop message (and its tensor) to the node `hop` names; to ourselves without the network."""
        msg = msg.replace(id=None, z=None, tensor=None)
        if hop.node == self.node.id:
            self.node.spawn(self._run_hop(msg, z))
            return
        conn = await self._connection(hop)
        if z is None:
            await conn.send(msg)
        else:
            await conn.send_tensor(z, "raw", then=msg)

    async def _reply(self, coordinator: Hop, msg: messages.Message) -> None:
        if coordinator.node == self.node.id:
            await (self.on_hop_done if isinstance(msg, messages.HopDone) else self.on_hop_error)(None, msg)
            return
        with contextlib.suppress(PeerGone):
            await (await self._connection(coordinator)).send(msg)

    async def on_hop(self, conn: Connection, msg: messages.Message) -> None:
        if conn.label == CLIENTS:
            raise ProtocolError("unexpected", "hops come from serving nodes; a client sends generate or score")
        self.node.spawn(self._run_hop(msg, msg.tensor))

    async def _run_hop(self, msg: messages.Message, z: torch.Tensor | None) -> None:
        try:
            coordinator = Hop.from_wire(msg.coordinator)
            route = [Hop.from_wire(h) for h in msg.route]
        except ValueError as exc:
            self.node.quiet.log(logging.WARNING, "bad hop", "hop with a malformed route dropped: %s", exc)
            return
        failed, at = self.node.id, msg.at
        try:
            if at >= len(route) or route[at].node != self.node.id or (route[at].first, route[at].last) != (
                    self.first, self.last):
                raise ValueError("the route names blocks this node does not serve")
            if msg.model != self.model_id:
                raise ValueError("the request is for another model than the one this node serves")
            check_temperature(msg)
            last = at == len(route) - 1
            result = await self.batcher.run((msg, z, None if last else route[at + 1].node), msg.session,
                                            len(msg.ctx) + msg.n_noisy)
            self.counters["hops"] += 1
            if last:
                await self._reply(coordinator, result)
            else:
                failed = route[at + 1].node
                tensor, fields = result
                try:
                    await self._deliver(route[at + 1], msg.replace(at=at + 1, **fields), tensor)
                except PeerGone:
                    self._forget_relayed(msg.session)  # the next hop may not hold what it was sent
                    raise
        except (ValueError, PeerGone, ProtocolError, RuntimeError) as exc:
            self.counters["failed_hops"] += 1
            self.node.quiet.log(logging.WARNING, "failed hop", "hop of session %s failed: %s", msg.session[:8], exc)
            await self._reply(coordinator, messages.HopError(session=msg.session, traversal=msg.traversal, node=failed,
                                                             message=str(exc),
                                                             stale=isinstance(exc, StaleSession) or None,
                                                             busy=isinstance(exc, Busy) or None))

    @abstractmethod
    def _compute_batch(self, hops: list[tuple[messages.Message, torch.Tensor | None, str | None]]) -> list:
        """This node's part of a batch of traversals (in a worker thread), each hop given as (message,
        tensor, next node or None on the last hop). Per hop: the hop_done on the last hop; before it,
        the tensor to pass on and the hop's fields that describe it; or the ValueError that refuses it."""

    def _forget_relayed(self, session: str) -> None:
        """After a failed hand-over: drop the session here, so that its next traversal recomputes it and
        relays the whole clean stream to whichever node comes next."""
        self.sessions.drop(session)

    @abstractmethod
    async def _generate(self, conn: Connection, msg: messages.Message) -> None:
        """Answer a `generate` request as its coordinator: traversals, bytes streamed to the client."""

    @abstractmethod
    async def _score(self, conn: Connection, msg: messages.Message) -> None:
        """Answer a `score` request as its coordinator."""

    def _done(self, msg: messages.Message, logits: torch.Tensor) -> messages.Message:
        """hop_done from the final logits (n, V): the NLL of the targets, or the sampled bytes."""
        done = messages.HopDone(session=msg.session, traversal=msg.traversal, data=b"", nll=0.0, count=0)
        if msg.targets is not None:
            if len(msg.targets) != logits.shape[0]:
                raise ValueError("targets must have one byte per position scored")
            y = torch.tensor(list(msg.targets), dtype=torch.long)
            return done.replace(nll=fn.cross_entropy(logits, y, reduction="sum").item(), count=len(msg.targets))
        if msg.draft:
            return done.replace(data=accept_draft(logits, msg.ctx[-msg.draft :], msg.temperature, msg.seed,
                                                  msg.traversal))
        return done.replace(data=sample_bytes(logits, msg.temperature, msg.seed, msg.traversal))

    def _check_generate(self, msg: messages.Message) -> None:
        check_seed(msg)
        check_temperature(msg)
        if len(msg.prompt) > MAX_PROMPT or not 0 < msg.n_bytes <= MAX_GENERATE:
            raise ValueError(f"prompt up to {MAX_PROMPT} bytes and 1 to {MAX_GENERATE} bytes to generate")

    def _incoming(self, z: torch.Tensor | None, n: int) -> torch.Tensor:
        """The tensor the previous hop sent: finite float32 (1, n, d_model), or ValueError."""
        d = self.cfg.model.d_model
        if z is None or z.dtype != torch.float32 or tuple(z.shape) != (1, n, d) or not torch.isfinite(z).all():
            raise ValueError(f"the tensor from the previous hop must be finite float32 (1, {n}, {d})")
        return z

    def _context(self, msg: messages.Message) -> torch.Tensor:
        if not 1 <= len(msg.ctx) <= self.cfg.model.context:
            raise ValueError(f"a context of {len(msg.ctx)} bytes is outside the window of {self.cfg.model.context}")
        return torch.tensor(list(msg.ctx), dtype=torch.long)[None, :]


class BlockServer(PipelineServer):
    """Serves consecutive BlockTrain blocks: each hop runs their Euler steps on the noisy tensor."""

    kind = "blocktrain"

    def __init__(self, node: Node, folder: str | Path, first: int, last: int, hop_timeout: float = 10.0,
                 retries: int = 2, cache_mb: float = 256.0, session_ttl: float = 300.0,
                 max_queued: int = 128) -> None:
        n_blocks = checkpoint.read_config(folder, checkpoint.block_name(first)).model.n_blocks
        if last >= n_blocks:
            raise ValueError(f"--serve {first}-{last}: the model in {folder} has blocks 0-{n_blocks - 1}")
        entries = [checkpoint.load(folder, checkpoint.block_name(b)) for b in range(first, last + 1)]
        cfg = entries[0].config
        for entry in entries[1:]:
            checkpoint.require_same_model(entry, cfg, folder, f"block {first}")
        if cfg.model.layout != "concat":
            raise ValueError("serving needs a concat-layout model (chunks of K bytes per traversal)")
        if cfg.noise.churn > 0:
            raise ValueError("serving runs the deterministic sampler; this model's noise config has churn > 0")
        # which model this is (not which weights: holders of a block may be a round apart)
        model_id = hashlib.sha256(repr((self.kind, cfg.model, cfg.noise)).encode()).hexdigest()[:16]
        super().__init__(node, cfg, first, last, model_id, hop_timeout, retries, cache_mb, session_ttl,
                         max_queued)
        self.blocks = {b: block_from(e, cfg, self.device, b)
                       for b, e in zip(range(first, last + 1), entries, strict=True)}
        self.codebook = make_codebook(cfg.model).to(self.device)
        self.grid = sigma_grid(cfg.noise, cfg.model.n_blocks)
        relay = cfg.model.channel == "relay"
        self.reads_relay = relay and first > 0  # its first block starts from block first-1's clean stream
        self.sends_relay = relay and last < cfg.model.n_blocks - 1  # the next node's first block reads its last
        # the clean streams a session keeps: its blocks', then the relayed one it reads
        self.stream_ids = [*sorted(self.blocks), *([first - 1] if self.reads_relay else [])]

    async def _generate(self, conn: Connection, msg: messages.Message) -> None:
        """ar: a byte per traversal; sweep: k bytes denoised together; spec: up to k drafted bytes
        checked with the next one (exact, as ar)."""
        context = self.cfg.model.context
        if msg.mode not in ("ar", "sweep", "spec"):
            raise ValueError(f"mode must be ar, sweep or spec, got {msg.mode!r}")
        self._check_generate(msg)
        chunk = (msg.k or min(msg.n_bytes, context - 1)) if msg.mode == "sweep" else 1  # 0: as many as fit
        draft = (msg.k or DEFAULT_DRAFT) if msg.mode == "spec" else 0
        if not 1 <= chunk <= context - 1 or draft > context - 1:
            raise ValueError(f"k must be in [1, {context - 1}]")
        session = os.urandom(8).hex()
        out = bytearray(msg.prompt or b"\n")
        produced, traversal, exclude, route = 0, 0, set(), None
        while produced < msg.n_bytes:
            t = next_traversal(out, msg.n_bytes - produced, chunk, draft, context)
            fields = {"session": session, "ctx": t.ctx, "start": t.start, "n_noisy": t.n_noisy, "chunk": t.chunk,
                      "temperature": float(msg.temperature), "seed": msg.seed, "draft": len(t.draft) or None}

            def retry(fields: dict = fields) -> dict:
                nonlocal session  # (the traversals after it go on in the new session)
                session = os.urandom(8).hex()
                return {**fields, "session": session}

            done, route = await self.traverse(produced, msg.route, exclude, fields, retry)  # (noise: keyed by byte)
            if not 1 <= len(done.data) <= max(t.n_noisy, len(t.draft) + 1):
                raise HopFailed("", f"the last hop returned {len(done.data)} bytes for {t.n_noisy} positions")
            out.extend(done.data)
            produced += len(done.data)
            traversal += 1
            await conn.send(messages.GenBytes(re=msg.id, data=done.data))
        await conn.send(messages.GenDone(re=msg.id, bytes=produced, traversals=traversal,
                                         route=[h.to_wire() for h in route]))

    async def _score(self, conn: Connection, msg: messages.Message) -> None:
        text, context = msg.text, self.cfg.model.context
        check_seed(msg)
        if not context + 1 <= len(text) <= MAX_TEXT:
            raise ValueError(f"text must be {context + 1} to {MAX_TEXT} bytes")
        if not 1 <= msg.chunk <= context:
            raise ValueError(f"chunk must be in [1, {context}]")
        offset = msg.offset or 0  # (of this text in a longer one a client split: its windows' noise keys)
        if offset > MAX_OFFSET:
            raise ValueError(f"offset must be at most 2^48, got {offset}")
        session, exclude, route = os.urandom(8).hex(), set(), None
        nll, count, windows = 0.0, 0, 0
        for i in range(0, len(text) - context, context):  # one traversal per window of context + 1 bytes
            if conn.closed:  # (nothing comes back before the end: stop once the client is gone)
                raise PeerGone("the client went away")
            window = text[i : i + context + 1]
            fields = {"session": session, "ctx": window[:-1], "start": 0, "n_noisy": len(window) - 1,
                      "chunk": msg.chunk, "temperature": 0.0, "seed": msg.seed, "targets": window[1:]}
            done, route = await self.traverse(offset + i, msg.route, exclude, fields)  # noise keyed by byte offset
            if done.count != context or not math.isfinite(done.nll):
                raise HopFailed("", f"the last hop scored {done.count} bytes of a window of {context} "
                                    f"(NLL {done.nll})")
            nll, count, windows = nll + done.nll, count + done.count, windows + 1
        await conn.send(messages.ScoreReply(re=msg.id, nll=nll, count=count, windows=windows,
                                            route=[h.to_wire() for h in route]))

    @torch.no_grad()
    def _compute_batch(self, hops: list[tuple[messages.Message, torch.Tensor | None, str | None]]) -> list:
        """Start from noise on the first hop, run this node's Euler steps, read off on the last: for
        every hop of the batch at once, packed into one sequence (model.Span), so concurrent sessions
        share each layer call.

        With the relay channel the hop's tensor carries, after the n noisy rows, the previous node's
        last clean stream over the context positions `relay_from`.. (those the receiver does not
        hold yet for the session: after the first traversal of an `ar` session, one per byte).
        """
        results: list = [None] * len(hops)
        ready: list[tuple[int, Prepared]] = []
        for i, (msg, z, _) in enumerate(hops):
            try:
                ready.append((i, self._prepare(msg, z)))
            except ValueError as exc:
                results[i] = exc
        if not ready:
            return results
        spb = self.cfg.noise.steps_per_block
        steps = range(self.first * spb, (self.last + 1) * spb)
        z = euler_steps(self.blocks, self.cfg.noise, self.grid, self.codebook, [p.span for _, p in ready],
                        torch.cat([p.z for _, p in ready], dim=1), steps, None, [p.streams for _, p in ready])
        zs = dict(zip([i for i, _ in ready], z.split([p.span.n for _, p in ready], dim=1), strict=True))
        last = [(i, p) for i, p in ready if hops[i][2] is None]
        if last:  # the read-off, for the hops whose route ends here
            sigma_min = torch.full((1,), self.cfg.noise.sigma_min)
            logits = self.blocks[self.last].forward_packed(
                [p.span for _, p in last], torch.cat([zs[i] for i, _ in last], dim=1), sigma_min,
                [p.streams[self.last] for _, p in last], [p.streams.get(self.last - 1) for _, p in last])
            for (i, _), part in zip(last, logits.float()[0].split([p.span.n for _, p in last]), strict=True):
                results[i] = _catch(self._done, hops[i][0], part)
        for i, p in ready:
            if hops[i][2] is not None:
                results[i] = self._hand_on(p, zs[i], hops[i][2])
        return results

    def _prepare(self, msg: messages.Message, z: torch.Tensor | None) -> Prepared:
        """Check a hop, and gather what this node's steps need: its span, its starting z, its streams."""
        n, start = msg.n_noisy, msg.start
        x = self._context(msg)
        if not (1 <= n and start + n <= self.cfg.model.context and 1 <= msg.chunk <= n
                and start <= x.shape[1] - 1):
            raise ValueError(f"{n} noisy bytes from position {start} do not fit the window of {self.cfg.model.context}")
        if msg.draft and (msg.targets is not None or msg.chunk != 1 or n != msg.draft + 1
                          or start + msg.draft != x.shape[1] - 1):
            raise ValueError("a hop that checks `draft` drafted bytes scores them and the byte after them, with "
                             "chunk 1, from the last clean byte before them")
        # a relay from position 0 comes from a node that holds nothing of the session (a new route)
        restart = self.reads_relay and msg.at > 0 and not msg.relay_from
        session = None if msg.targets is not None else self._session(msg.session, msg.ctx, restart)
        streams = {} if session is None else dict(zip(self.stream_ids, session.caches, strict=True))
        if msg.at == 0:  # the first hop starts from noise, each position's from its byte's generator
            z = self.grid[0].item() * starting_noise(msg.seed, msg.traversal, n, self.cfg.model.d_model, self.device)
        elif self.reads_relay:
            rows = x.shape[1] - (msg.relay_from if msg.relay_from is not None else 0)
            z = self._incoming(z, n + rows)
            self._take_relay(streams, msg.relay_from, z[:, n:], x.shape[1])
            z = z[:, :n]
        else:
            z = self._incoming(z, n)
        return Prepared(Span(x, start, n, msg.chunk), z, streams, session)

    def _hand_on(self, hop: Prepared, z: torch.Tensor, next_node: str) -> tuple[torch.Tensor, dict]:
        """The tensor for the next node: z, then (relay channel) the clean stream positions it lacks."""
        if not self.sends_relay:
            return z, {}
        session, x = hop.session, hop.span.x
        held = session.relayed[1] if session is not None and session.relayed[0] == next_node else 0
        if session is not None:
            session.relayed = (next_node, x.shape[1])
        self.counters["relayed_rows"] += x.shape[1] - held
        return torch.cat([z, hop.streams[self.last].out[:, held:]], dim=1), {"relay_from": held}

    def _take_relay(self, streams: dict[int, CleanStream], relay_from: int | None, rows: torch.Tensor,
                    n_clean: int) -> None:
        """Extend the session's copy of block first-1's clean stream with the rows the hop relayed."""
        held = streams.setdefault(self.first - 1, CleanStream(0))
        if relay_from is None:
            raise ValueError(f"block {self.first} reads block {self.first - 1}'s clean stream (channel 'relay'): the "
                             f"hop must relay it (relay_from)")
        if relay_from != held.seen:
            raise StaleSession(f"the hop relays the clean stream from position {relay_from}, and this node holds "
                               f"{held.seen} positions of the session")
        if relay_from + rows.shape[1] != n_clean:
            raise ValueError("the relayed clean stream must reach the end of the context")
        held.out = rows.clone() if held.out is None else torch.cat([held.out, rows], dim=1)

    def _session(self, session: str, ctx: bytes, restart: bool = False) -> Session:
        """A generation session's clean streams (this node's blocks', then the relayed one), valid for ctx.

        While the window only grows (the prompt and output fit the context) each traversal adds
        its new bytes to the streams; once it slides, or the previous node relays the whole
        context again (`restart`: a new route), they are rebuilt.
        """
        layers = self.cfg.model.layers_per_block
        found = self.sessions.get(session, lambda: [CleanStream(layers) for _ in self.blocks] + (
            [CleanStream(0)] if self.reads_relay else []))
        if restart:
            found.reset()
        found.keep(ctx)
        return found


class ReferenceServer(PipelineServer):
    """Serves the end-to-end reference's layers for the blocks' share of depth: the plain
    autoregressive pipeline BlockTrain is compared with. Each hop passes on the hidden states of
    the positions new to the session; every node keeps the session's keys and values (KV cache)."""

    kind = "reference"

    def __init__(self, node: Node, folder: str | Path, first: int, last: int, hop_timeout: float = 10.0,
                 retries: int = 2, cache_mb: float = 256.0, session_ttl: float = 300.0,
                 max_queued: int = 128) -> None:
        entry = checkpoint.load(folder, checkpoint.REFERENCE)
        cfg = entry.config
        if last >= cfg.model.n_blocks:
            raise ValueError(f"--serve {first}-{last}: the reference in {folder} has the depth of blocks "
                             f"0-{cfg.model.n_blocks - 1}")
        if cfg.model.reference_layout != "plain":
            raise ValueError("the reference pipeline serves a plain reference (--reference-layout plain)")
        model_id = hashlib.sha256(repr((self.kind, cfg.model)).encode()).hexdigest()[:16]
        super().__init__(node, cfg, first, last, model_id, hop_timeout, retries, cache_mb, session_ttl,
                         max_queued)
        _, self.model = load_reference(folder, self.device)
        per_block = cfg.model.layers_per_block
        self.layers = list(self.model.layers)[first * per_block : (last + 1) * per_block]

    async def _generate(self, conn: Connection, msg: messages.Message) -> None:
        """Autoregressive only: one byte per traversal, the session's positions cached on every node.

        When the window is full the session restarts on its last half (a new session id), so
        positions stay within the model's context.
        """
        context = self.cfg.model.context
        if msg.mode != "ar":
            raise ValueError("a reference pipeline generates in mode ar")
        self._check_generate(msg)
        out = bytearray(msg.prompt or b"\n")
        session = {"id": "", "start": 0, "sent": 0}  # start: its position 0 in out

        def fields(restart: bool = False) -> dict:
            """The positions the session's nodes have not seen; a new session (from the window's start)
            when the window moves on (by half, chain.window_start: the windows BlockTrain's `ar` reads)
            or after a failure, when the nodes' caches cannot be trusted."""
            begin = window_start(len(out), 1, context)
            if restart or not session["id"] or begin != session["start"]:
                session["id"], session["start"], session["sent"] = os.urandom(8).hex(), begin, 0
            new = bytes(out[session["start"] + session["sent"] :])
            return {"session": session["id"], "ctx": new, "start": session["sent"], "n_noisy": len(new), "chunk": 1,
                    "temperature": float(msg.temperature), "seed": msg.seed}

        exclude, route = set(), None
        for traversal in range(msg.n_bytes):
            done, route = await self.traverse(traversal, msg.route, exclude, fields(),
                                              lambda: fields(restart=True))
            if len(done.data) != 1:
                raise HopFailed("", f"the last hop returned {len(done.data)} bytes, not 1")
            session["sent"] = len(out) - session["start"]
            out.extend(done.data)
            await conn.send(messages.GenBytes(re=msg.id, data=done.data))
        await conn.send(messages.GenDone(re=msg.id, bytes=msg.n_bytes, traversals=msg.n_bytes,
                                         route=[h.to_wire() for h in route]))

    async def _score(self, conn: Connection, msg: messages.Message) -> None:
        raise ValueError("a reference pipeline only generates; score with `spheroid eval` on its checkpoint")

    @torch.no_grad()
    def _compute_batch(self, hops: list[tuple[messages.Message, torch.Tensor | None, str | None]]) -> list:
        """This node's layers on the new positions of every hop of the batch, packed into one sequence
        (each session's positions attend to its own cache); the last node reads off the next byte."""
        results: list = [None] * len(hops)
        ready: list[tuple[int, list[KVCache], torch.Tensor]] = []
        context = self.cfg.model.context
        for i, (msg, z, _) in enumerate(hops):
            if not 1 <= msg.n_noisy <= context - msg.start or (msg.at == 0 and msg.n_noisy != len(msg.ctx)):
                results[i] = ValueError(f"{msg.n_noisy} new positions from position {msg.start} do not fit the "
                                        f"window of {context}, or are not the context's")
                continue
            caches = self.sessions.get(msg.session, lambda: [KVCache() for _ in self.layers]).caches
            held = 0 if caches[0].k is None else caches[0].k.shape[2]
            if held != msg.start:
                self.sessions.drop(msg.session)  # out of step: the coordinator retries on a new session
                results[i] = StaleSession(f"session {msg.session[:8]} holds {held} positions, not {msg.start}")
                continue
            try:
                ready.append((i, caches, self.model.embed(self._context(msg), msg.start) if msg.at == 0
                              else self._incoming(z, msg.n_noisy)))
            except ValueError as exc:
                results[i] = exc
        if not ready:
            return results
        new = [h.shape[1] for _, _, h in ready]
        h = torch.cat([h for _, _, h in ready], dim=1)
        mask = packed_causal([hops[i][0].start for i, _, _ in ready], new, h.device)
        for n, layer in enumerate(self.layers):
            h = layer(h, mask, None, packed_kv([caches[n] for _, caches, _ in ready], new))
        for (i, _, _), part in zip(ready, h.split(new, dim=1), strict=True):
            msg, _, next_node = hops[i]
            results[i] = (part, {}) if next_node is not None else _catch(
                self._done, msg, self.model.head(self.model.norm(part[0, -1:])).float())
        return results
