"""A serving node of the end-to-end reference's layers: the plain autoregressive pipeline, KV-cached."""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import checkpoint
from ...decoding import Decoder, Traversal
from ...loading import load_reference
from ...model import KVCache, packed_causal, packed_kv
from ...wire import messages
from ..connection import Connection
from ..node import Node
from .base import HopFailed, PipelineServer, caught
from .sessions import StaleSession


@dataclass
class RouteSession:
    """A reference pipeline's session on its route's nodes, as its coordinator knows it: its id, where
    its position 0 is in the text, and how many positions the nodes hold (sent before)."""

    id: str = ""
    start: int = 0
    sent: int = 0


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
        if msg.mode not in ("ar", "spec"):  # (spec, the client's default, is ar's output: here ar itself)
            raise ValueError("a reference pipeline generates in mode ar")
        self._check_generate(msg)
        decoder = Decoder(msg.prompt, msg.n_bytes, context, float(msg.temperature), msg.seed)  # (ar: chunk 1)
        session = RouteSession()

        def fields(t: Traversal, restart: bool = False) -> dict:
            """The positions of t's window the session's nodes have not seen; a new session (from the
            window's start) when the window moves on (by half: the windows BlockTrain's `ar` reads)
            or after a failure, when the nodes' caches cannot be trusted."""
            if restart or not session.id or t.window != session.start:
                session.id, session.start, session.sent = os.urandom(8).hex(), t.window, 0
            new = t.ctx[session.sent :]
            return {"session": session.id, "ctx": new, "start": session.sent, "n_noisy": len(new), "chunk": 1,
                    "temperature": float(msg.temperature), "seed": msg.seed}

        exclude, route = set(), None
        while not decoder.done:
            t = decoder.next()
            done, route = await self.traverse(t.first, msg.route, exclude, fields(t),
                                              functools.partial(fields, t, restart=True))
            if len(done.data) != 1:
                raise HopFailed("", f"the last hop returned {len(done.data)} bytes, not 1")
            session.sent = len(t.ctx)
            decoder.take(t, done.data)
            await conn.send(messages.GenBytes(re=msg.id, data=done.data))
        await conn.send(messages.GenDone(re=msg.id, bytes=decoder.produced, traversals=decoder.traversals,
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
            results[i] = (part, {}) if next_node is not None else caught(
                self._done, msg, self.model.read_off(part[0, -1:]).float())
        return results
