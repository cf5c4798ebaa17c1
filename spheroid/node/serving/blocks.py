"""A serving node of BlockTrain blocks: each hop runs their Euler steps on the noisy tensor."""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import checkpoint
from ...chain import euler_steps, read_off
from ...decoding import DEFAULT_DRAFT, Decoder, starting_noise
from ...loading import block_from
from ...model import CleanStream, Span, make_codebook
from ...noise import sigma_grid
from ...wire import messages
from ..connection import Connection, PeerGone
from ..node import Node
from .base import MAX_OFFSET, MAX_TEXT, HopFailed, PipelineServer, caught, check_seed
from .sessions import Session, StaleSession


@dataclass
class Prepared:
    """A BlockTrain hop checked and ready for this node's steps: its span, starting z (1, n, d), the
    session's clean streams (block index -> stream) and the session (None when scoring)."""

    span: Span
    z: torch.Tensor
    streams: dict[int, CleanStream]
    session: Session | None


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
        checked with the next one (exact, as ar). The decode loop is local generation's (`Decoder`)."""
        context = self.cfg.model.context
        if msg.mode not in ("ar", "sweep", "spec"):
            raise ValueError(f"mode must be ar, sweep or spec, got {msg.mode!r}")
        self._check_generate(msg)
        chunk = (msg.k or min(msg.n_bytes, context - 1)) if msg.mode == "sweep" else 1  # 0: as many as fit
        draft = (msg.k or DEFAULT_DRAFT) if msg.mode == "spec" else 0
        if not 1 <= chunk <= context - 1 or draft > context - 1:
            raise ValueError(f"k must be in [1, {context - 1}]")
        decoder = Decoder(msg.prompt, msg.n_bytes, context, float(msg.temperature), msg.seed, chunk, draft)
        session, exclude, route = os.urandom(8).hex(), set(), None
        while not decoder.done:
            t = decoder.next()
            fields = {"session": session, "ctx": t.ctx, "start": t.start, "n_noisy": t.n_noisy, "chunk": t.chunk,
                      "temperature": float(msg.temperature), "seed": msg.seed, "draft": len(t.draft) or None}

            def retry(fields: dict = fields) -> dict:
                nonlocal session  # (the traversals after it go on in the new session)
                session = os.urandom(8).hex()
                return {**fields, "session": session}

            done, route = await self.traverse(t.first, msg.route, exclude, fields, retry)  # (noise: keyed by byte)
            if not 1 <= len(done.data) <= t.most:
                raise HopFailed("", f"the last hop returned {len(done.data)} bytes for {t.n_noisy} positions")
            decoder.take(t, done.data)
            await conn.send(messages.GenBytes(re=msg.id, data=done.data))
        await conn.send(messages.GenDone(re=msg.id, bytes=decoder.produced, traversals=decoder.traversals,
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
            logits = read_off(self.blocks[self.last], self.cfg.noise, [p.span for _, p in last],
                              torch.cat([zs[i] for i, _ in last], dim=1), [p.streams[self.last] for _, p in last],
                              [p.streams.get(self.last - 1) for _, p in last])
            for (i, _), part in zip(last, logits[0].split([p.span.n for _, p in last]), strict=True):
                results[i] = caught(self._done, hops[i][0], part)
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
