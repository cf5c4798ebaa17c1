"""A client of the swarm: connects to one node, does the handshake as role "client", asks things.

Clients are not members: nodes never gossip them. `spheroid status` is built on this.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.nn.utils import vector_to_parameters

from .. import checkpoint
from ..averaging import SharedState, Version
from ..config import REFERENCE_PART, NodeConfig, RunConfig, parse_addr
from ..model import part_module
from ..status import NodeStatus
from ..wire import ProtocolError
from ..wire.messages import (
    Error,
    GenBytes,
    GenDone,
    Generate,
    Message,
    Peers,
    Ping,
    Pong,
    Score,
    ScoreReply,
    StateGet,
    Status,
)
from ..wire.session import is_node_id
from .accounting import Traffic
from .connection import Connection, PeerGone, PeerRefused, PeerSilent, dial, handshake_failure
from .node import open_session, ssl_contexts

log = logging.getLogger(__name__)

# what a spheroid node's hello can be refused for; any other error before it means another protocol
HANDSHAKE_REFUSALS = {"version", "swarm", "auth_required", "auth_failed", "self", "handshake"}
MAX_MEMBERS = 1 << 16  # node ids a state transfer may name as the group of its next round


async def connect(addr: str, cfg: NodeConfig, secret: bytes | None = None, handler=None) -> Connection:
    """An authenticated connection to the node at addr, reading replies in the background.

    cfg supplies the swarm, the timeout and the TLS files; the client takes a fresh id each time.
    Messages that answer no pending request go to `handler` (ignored without one). A node that is
    `busy` (too many connections in their handshake) is asked again, backing off, for cfg.timeout.
    """
    deadline, wait = time.monotonic() + cfg.timeout, 0.05
    while True:
        try:
            return await _connect_once(addr, cfg, secret, handler)
        except PeerRefused as exc:
            if exc.code != "busy" or time.monotonic() > deadline:
                raise
        await asyncio.sleep(wait * random.uniform(0.5, 1.5))
        wait = min(2.0, 2 * wait)


async def _connect_once(addr: str, cfg: NodeConfig, secret: bytes | None, handler) -> Connection:
    host, port = parse_addr(addr)
    _, client_ssl = ssl_contexts(cfg)
    me = {"node": os.urandom(16).hex(), "addr": "", "role": "client", "blocks": [], "boot": os.urandom(8)}
    session = open_session(me, cfg, secret, True, cfg.recv_budget)
    conn = await dial(host, port, Traffic(), session, cfg.timeout, client_ssl)
    try:
        await asyncio.wait_for(conn.open(), cfg.handshake_timeout)
    except (TimeoutError, PeerSilent) as exc:
        await conn.close()
        raise TimeoutError(f"{addr} sent no spheroid hello within {cfg.timeout:.0f}s: is it a spheroid node's "
                           f"address?") from exc
    except ProtocolError as exc:
        await conn.close()
        if exc.code in ("auth_required", "auth_failed"):  # (this side noticed first: the same words)
            raise ProtocolError(exc.code, handshake_failure(exc, f"the node at {addr}", "this client",
                                                            secret is not None)) from exc
        if exc.code in HANDSHAKE_REFUSALS:  # a spheroid node that will not talk to us says why
            raise
        raise ProtocolError(exc.code, f"{addr} does not speak the spheroid protocol ({exc}): is it a spheroid "
                                      f"node's address?") from exc
    except PeerRefused as exc:
        await conn.close()
        if exc.code in ("auth_required", "auth_failed", "tls_required"):  # (a mistake in this client's flags)
            raise PeerRefused(exc.code, handshake_failure(exc, f"the node at {addr}", "this client",
                                                          secret is not None)) from exc
        raise
    except BaseException:
        await conn.close()
        raise

    async def answer(conn: Connection, msg: Message) -> None:
        """Pings are answered (the keepalive rule: a node drops a client that stays silent); other
        messages that answer no request go to `handler`."""
        if isinstance(msg, Ping):
            await conn.send(Pong(re=msg.id, ts=msg.ts))
        elif handler is not None:
            await handler(conn, msg)

    conn.reader_task = asyncio.get_running_loop().create_task(conn.serve(answer, idle_timeout=3600))
    return conn


async def fetch_status(addr: str, cfg: NodeConfig, secret: bytes | None = None) -> dict:
    """The status of the node at addr, as the node reports it: the map (`fetch_node_status` reads it)."""
    conn = await connect(addr, cfg, secret)
    try:
        return (await conn.request(Status())).status
    finally:
        await conn.close()


def read_status(addr: str, status: dict) -> NodeStatus:
    """The status map the node at addr sent, checked: ValueError that names the node and the field."""
    try:
        return NodeStatus.from_dict(status)
    except ValueError as exc:
        raise ValueError(f"{addr} sent a malformed status: {exc}") from exc


async def fetch_node_status(addr: str, cfg: NodeConfig, secret: bytes | None = None) -> NodeStatus:
    """The status of the node at addr, checked (ValueError if it is malformed)."""
    return read_status(addr, await fetch_status(addr, cfg, secret))


async def assemble_swarm(addr: str, cfg: NodeConfig, out: Path, secret: bytes | None = None
                         ) -> list[tuple[int, str, Version]]:
    """Collect the preferred state of every block from the swarm reachable through addr into `out`
    (and of the end-to-end reference, where replicas of it train: DiLoCo-style data parallel).

    Crawls the membership from addr, reads every training member's version, and fetches each part
    from a holder of its preferred version (later round, more samples, smaller hash: the rule the
    replicas themselves use). Returns (part, holder address, version) per part (REFERENCE_PART for
    the reference). Assembly is only collecting: no step runs after it.
    """
    members = await crawl(addr, cfg, secret)
    best: dict[int, tuple[Version, str]] = {}
    reads: dict[int, dict] = {}  # per block, the versions of the earlier blocks its holder read
    n_blocks = None
    for member_addr, status in members.items():
        training = status.training
        if training is None:
            continue
        part = training.block
        if part != REFERENCE_PART:
            n_blocks = training.n_blocks
        version = training.version
        if part not in best or version.preferred_over(best[part][0]):
            best[part] = (version, member_addr)
            reads[part] = {name: dict(read) for name, read in training.earlier.reads.items()}
    if not best:
        raise PeerGone(f"no node reachable through {addr} trains a block or the reference")
    missing = [b for b in range(n_blocks or 0) if b not in best]
    if missing:
        raise PeerGone(f"no reachable node holds block(s) {missing}; start nodes for them or wait for gossip")
    found, first_cfg = [], None
    for part, (_, holder) in sorted(best.items()):
        run_cfg, state = await fetch_state(holder, part, cfg, secret)
        module = part_module(run_cfg.model, run_cfg.noise.sigma_data, part)
        if part == REFERENCE_PART:
            name, record = checkpoint.REFERENCE, {}
        else:
            name, record = checkpoint.block_name(part), {"block": part, "reads": reads[part]}
            if first_cfg is not None and (run_cfg.model, run_cfg.noise) != (first_cfg.model, first_cfg.noise):
                raise PeerGone(f"block {part} from {holder} belongs to another model than block 0")
            first_cfg = first_cfg or run_cfg
        vector_to_parameters(state.params, module.parameters())
        checkpoint.save(out, name, module, run_cfg, {**record, **state.version.to_wire(), "source": holder})
        found.append((part, holder, state.version))
    return found


async def fetch_state(addr: str, block: int, cfg: NodeConfig, secret: bytes | None = None
                      ) -> tuple[RunConfig, SharedState]:
    """A block's shared state (hash verified) and run configuration, from the node at addr."""
    conn = await connect(addr, cfg, secret)
    try:
        return await request_state(conn, block)
    finally:
        await conn.close()


@dataclass(frozen=True)
class StateDelta:
    """What a holder may send instead of its state: the change from parameters the requester holds
    to its state's, through a lossy codec. Added to them it gives a close copy of `version`, not an
    exact one (its hash cannot be verified): good enough for a frozen copy a later block reads."""

    version: Version  # the holder's state it leads to
    since: str  # hash of the parameters it starts from
    delta: torch.Tensor  # (P,) float32: the parameters' change (no outer momentum)


def with_holder_notes(state: SharedState, reply: Message) -> SharedState:
    """A fetched state with what its holder said of the round that starts from it (`members`, its
    group; `left`, the share of its local steps the holder had still to train), checked: ValueError
    if they do not make sense."""
    if reply.members is not None:
        if len(reply.members) > MAX_MEMBERS or not all(is_node_id(m) for m in reply.members):
            raise ValueError(f"its group is not a list of at most {MAX_MEMBERS} node ids")
        state = replace(state, members=tuple(reply.members))
    if reply.left is not None:
        if not 0.0 <= reply.left <= 1.0:  # (also refuses NaN)
            raise ValueError(f"the share of its round left to train is {reply.left}, not in [0, 1]")
        state = replace(state, left=reply.left)
    return state


async def request_state(conn: Connection, block: int, n_params: int | None = None, since: str | None = None,
                        codec: str | None = None) -> tuple[RunConfig, SharedState | StateDelta]:
    """Ask a peer for its state of `block`: its run configuration and the state, size and hash verified;
    or, asked `since` parameters this node holds (their hash) and in `codec`, maybe the change from
    them (in that codec or a finer one: the holder's choice), size checked.

    ValueError if the reply does not add up; PeerGone if the peer cannot or will not send it.
    """
    reply = await conn.request(StateGet(block=block, since=since, codec=codec, within=conn.timeout))
    if reply.block != block:
        raise ValueError(f"the state of block {reply.block}, not of block {block}")
    run_cfg = RunConfig.from_dict(reply.config)
    if n_params is None:  # (counted without allocating them: the config is the peer's)
        with torch.device("meta"):
            shape = part_module(run_cfg.model, run_cfg.noise.sigma_data, block)
        n_params = sum(p.numel() for p in shape.parameters())
    version = Version(reply.round, reply.samples, reply.hash)
    if reply.since is None:
        return run_cfg, with_holder_notes(SharedState.unpack(version, reply.tensor, n_params), reply)
    delta = reply.tensor
    if reply.since != since:
        raise ValueError(f"a change from parameters {reply.since[:12]}, which this node did not ask for")
    if delta.dtype != torch.float32 or delta.dim() != 1 or delta.numel() != n_params:
        raise ValueError(f"a change of block {block} is {n_params} float32 values, got {tuple(delta.shape)} "
                         f"{delta.dtype}")
    if not torch.isfinite(delta).all():
        raise ValueError("NaN or Inf in the change")
    return run_cfg, StateDelta(version, since, delta)


async def crawl(addr: str, cfg: NodeConfig, secret: bytes | None = None, limit: int = 256) -> dict[str, NodeStatus]:
    """The status of every member reachable from addr (breadth first over their peer lists), by address.

    addr must answer, with a well-formed status; members that do not are skipped with a warning.
    """
    members: dict[str, NodeStatus] = {}
    queue, seen = [addr], {addr}
    while queue and len(members) < limit:
        here = queue.pop(0)
        try:
            conn = await connect(here, cfg, secret)
            try:
                status = (await conn.request(Status())).status
                peers = (await conn.request(Peers())).peers
            finally:
                await conn.close()
        except (OSError, TimeoutError, PeerGone) as exc:
            if here == addr:
                raise
            log.warning("skipping %s: %s", here, exc)
            continue
        try:
            members[here] = read_status(here, status)
        except ValueError as exc:
            if here == addr:
                raise
            log.warning("skipping %s: %s", here, exc)
            continue
        for entry in peers:
            if isinstance(entry, dict) and isinstance(entry.get("addr"), str) and entry["addr"] not in seen:
                seen.add(entry["addr"])
                queue.append(entry["addr"])
    return members


async def remote_generate(addr: str, cfg: NodeConfig, request: dict, on_bytes=None, secret: bytes | None = None,
                          timeout: float = 300.0) -> dict:
    """Ask the serving node at addr to generate through the pipeline; `on_bytes` gets bytes as they come.

    `request` holds the fields of a `generate` message. Returns the final gen_done message's fields
    with "data" (all the bytes) added; PeerGone on an error reply.
    """
    chunks: list[bytes] = []
    received = 0

    def on_message(msg: Message, done: asyncio.Future) -> bool:
        nonlocal received
        if isinstance(msg, GenBytes):
            received += len(msg.data)
            if received > request["n_bytes"]:
                done.set_exception(PeerGone(f"{addr} sent {received} bytes of the {request['n_bytes']} asked for"))
                return True
            chunks.append(msg.data)
            if on_bytes is not None:
                on_bytes(msg.data)
        elif isinstance(msg, GenDone):
            done.set_result({**msg.to_wire(), "data": b"".join(chunks)})
        return isinstance(msg, (GenBytes, GenDone))

    return await _streamed(addr, cfg, secret, Generate(**request), on_message, timeout)


async def remote_score(addr: str, cfg: NodeConfig, request: dict, secret: bytes | None = None,
                       timeout: float = 600.0) -> dict:
    """CE of a text through the pipeline that the serving node at addr coordinates: its score_reply's fields."""

    def on_message(msg: Message, done: asyncio.Future) -> bool:
        if isinstance(msg, ScoreReply):
            done.set_result(msg.to_wire())
        return isinstance(msg, ScoreReply)

    return await _streamed(addr, cfg, secret, Score(**request), on_message, timeout)


SCORE_PIECE = 1 << 16  # bytes of text per score request when score_text splits a text
SCORE_IN_FLIGHT = 4  # score requests at once (the coordinator's hops of all of them are batched)


async def score_text(addr: str, cfg: NodeConfig, text: bytes, context: int, request: dict,
                     secret: bytes | None = None, timeout: float = 600.0, piece: int = SCORE_PIECE,
                     on_scored: Callable[[int], None] = lambda _: None) -> dict:
    """CE of a text of any length through the pipeline: score requests of about `piece` bytes, a few at
    once, summed (`request`: the other fields of each, chunk, seed and route).

    A node takes at most 1 MiB a request, and answers only at the end of one: pieces let a text of
    any size be scored, show progress (`on_scored(bytes scored so far)`), and keep the serving
    nodes' batches full. Each piece starts on a window boundary (a multiple of the context) and
    names its `offset` in the text, which keys its windows' noise, so the windows and their noise
    are exactly those of one request for the whole text."""
    step = max(1, piece // context) * context  # windows per piece: whole ones
    starts = [s for s in range(0, len(text), step) if len(text) - s >= context + 1]  # (a shorter tail fills no window)
    if not starts:
        raise ValueError(f"a text of {len(text)} bytes fills no window of {context + 1} bytes (the context + 1)")
    replies: dict[int, dict] = {}
    gate = asyncio.Semaphore(SCORE_IN_FLIGHT)

    async def one(start: int) -> None:
        async with gate:
            replies[start] = await remote_score(addr, cfg, {**request, "text": text[start : start + step + 1],
                                                            "offset": start}, secret, timeout)
        on_scored(sum(r["count"] for r in replies.values()))

    tasks = [asyncio.ensure_future(one(start)) for start in starts]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # (the others, once one failed)
    in_order = [replies[start] for start in starts]  # (the same sums whichever piece came first)
    return {"nll": sum(r["nll"] for r in in_order), "count": sum(r["count"] for r in in_order),
            "windows": sum(r["windows"] for r in in_order), "route": in_order[-1]["route"]}


async def _streamed(addr: str, cfg: NodeConfig, secret: bytes | None, message: Message,
                    on_message: Callable[[Message, asyncio.Future], bool], timeout: float) -> dict:
    """Send a request whose answer comes as several messages, each given to `on_message` until it
    sets the result (it says whether the message is one of the answer's types); an error reply
    fails it, and so do `timeout` seconds without a message of the answer (a long generation goes
    on as long as its bytes come). Pings meanwhile, so the node knows we are here."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    heard = loop.time()

    async def route(_conn: Connection, msg: Message) -> None:
        nonlocal heard
        if msg.re is None or msg.re != message.id or done.done():
            return
        if isinstance(msg, Error):
            done.set_exception(PeerGone(f"{addr} answered {msg.code}: {msg.message}"))
        elif on_message(msg, done):
            heard = loop.time()

    conn = await connect(addr, cfg, secret, route)

    async def keep_alive() -> None:
        while True:
            await asyncio.sleep(cfg.ping_interval)
            await conn.send(Ping(ts=time.monotonic()))

    pinger = asyncio.ensure_future(keep_alive())
    try:
        message = message.replace(id=conn.next_id())
        await conn.send(message)
        closed = conn.reader_task
        while not done.done() and not closed.done() and (left := heard + timeout - loop.time()) > 0:
            await asyncio.wait({done, closed}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            raise PeerGone(f"{addr} closed the connection" if closed.done() else
                           f"{addr} sent nothing for this request in {timeout:g}s: raise --timeout if it is slow")
        return done.result()
    finally:
        pinger.cancel()
        await conn.close()
