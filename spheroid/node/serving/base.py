"""What every serving node does, whatever it serves: coordinate client requests along routes (the
traversals of a request, re-routed around failures), and run and relay the hops of traversals."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as fn

from ...config import RunConfig
from ...decoding import pick_bytes
from ...pipeline import Hop, NoRoute, build_route, check_route, serving_range
from ...progress import QuietLog
from ...status import ServingStatus
from ...wire import ProtocolError, messages
from ..connection import Connection, PeerGone
from ..node import CLIENTS, Node
from .batcher import Allowance, Batcher
from .sessions import Busy, SessionCache, StaleSession

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


def caught(work: Callable, *args: object) -> object:
    """work(*args), or the exception it raised: one hop's failure refuses that hop, not its batch."""
    try:
        return work(*args)
    except Exception as exc:  # noqa: BLE001 - whatever it was, the other hops of the batch go on
        if not isinstance(exc, ValueError):
            QUIET.log(logging.ERROR, "read-off", "a hop's read-off failed", exc_info=True)
        return exc


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

    def status(self) -> ServingStatus:
        return ServingStatus(blocks=(self.first, self.last), n_blocks=self.cfg.model.n_blocks, kind=self.kind,
                             context=self.cfg.model.context, model=self.model_id, sessions=len(self.sessions),
                             cache_bytes=self.sessions.nbytes, **self.counters)

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
        draft = msg.ctx[-msg.draft :] if msg.draft else b""
        return done.replace(data=pick_bytes(logits, draft, msg.temperature, msg.seed, msg.traversal))

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
