"""A node that trains one block: local steps in a worker thread, then a round with same-block peers.

The round logic lives in spheroid/averaging.py (sans I/O); this module is its asyncio side: it
streams updates to the peers that hold the same block, feeds what arrives into the `Replica`,
closes rounds at their deadline, announces the resulting `Version`, fetches a preferred state from
the peer that announced it (a joiner, a restarted or a diverged replica), serves its own state to
others, and checkpoints after every round (one safetensors file: parameters, the outer momentum,
the AdamW state and the version, written atomically). Optimizer state never leaves the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_safetensors
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ..averaging import CODECS, AveragingConfig, Replica, SharedState, Update, Version
from ..checkpoint import CheckpointError, atomic_write
from ..config import RunConfig
from ..data import random_windows
from ..model import make_codebook
from ..train import (
    block_loss,
    genesis_block,
    learning_rate,
    load_optimizer_tensors,
    make_optimizer,
    optimizer_tensors,
    train_step,
)
from ..wire import ProtocolError, messages, through_codec
from .client import request_state
from .connection import Connection, PeerGone
from .node import Node

log = logging.getLogger(__name__)

MAX_SERVING = 2  # state transfers a donor runs at once; more requesters are told to try another holder
HISTORY = 50  # rounds kept in the status
JOIN_WAIT_S = 3.0  # a fresh node waits up to this long for its first peer,
JOIN_SETTLE_S = 0.5  # then listens this long for versions before it picks a donor


def pick_donor(me: str, holders: list[str]) -> str:
    """Rendezvous hashing: each joiner ranks the holders of a state its own way, so joiners spread."""
    return max(holders, key=lambda h: hashlib.sha256((me + h).encode()).digest())


def same_run(a: RunConfig, b: RunConfig) -> bool:
    """Whether two replicas train the same model under the same noise schedule."""
    return a.model == b.model and a.noise == b.noise


class BlockWorker:
    def __init__(self, node: Node, cfg: RunConfig, averaging: AveragingConfig, block: int, data: torch.Tensor,
                 out: Path) -> None:
        if cfg.train.block_input != "noised":
            raise ValueError("a swarm node trains its block on noised inputs (--block-input noised): chain-state "
                             "training reads the earlier blocks, and in a swarm blocks never wait for each other")
        if cfg.model.channel != "z" and cfg.model.n_blocks > 1:
            raise ValueError("a swarm node trains blocks that read only z (--channel z): the relay channel reads "
                             "the earlier blocks, which swarm nodes do not fetch yet")
        if not 0 <= block < cfg.model.n_blocks:
            raise ValueError(f"--block {block} is outside 0..{cfg.model.n_blocks - 1}")
        self.node, self.cfg, self.avg, self.block, self.data = node, cfg, averaging, block, data
        self.path = Path(out) / f"worker-{block}.safetensors"
        self.module = genesis_block(cfg, block)  # every replica starts from the same genesis state
        self.opt = make_optimizer(self.module, cfg)
        self.loss_fn = block_loss(self.module, cfg, block, make_codebook(cfg.model))
        # each replica draws its own batches and noise
        node_seed = int(node.id[:8], 16)
        self.gen = torch.Generator().manual_seed(cfg.train.seed ^ node_seed)
        torch.manual_seed(cfg.train.seed * 7919 + node_seed)
        self.step, self.loss, self.ce = 0, float("nan"), float("nan")
        self.n_params = sum(p.numel() for p in self.module.parameters())
        state = self._resume() if self.path.exists() else self._genesis()
        self.fresh = state.version.round == 0 and self.step == 0
        # reached its state by a round (or genesis) and still training: not a fetch, a restart or done
        self.synced = self.fresh
        self.replica = Replica(node.id, state, averaging)
        self.pending: SharedState | None = None  # a fetched state to adopt between training chunks
        self.fetching = False
        self.serving = 0
        self.served = 0
        self.done = False
        self.history: list[dict] = []  # the last rounds: how many updates, how long this node waited
        self.changed = asyncio.Event()
        node.handlers.update(update=self.on_update, version=self.on_version, state_get=self.on_state_get)
        node.peer_hooks.append(self.on_peer)
        node.status_parts["training"] = self.status
        node.line_parts.append(self.status_line)

    # --- state ------------------------------------------------------------------------------------

    def params(self) -> torch.Tensor:
        return parameters_to_vector(self.module.parameters()).detach().clone()

    def set_params(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            vector_to_parameters(flat.clone(), self.module.parameters())

    def _genesis(self) -> SharedState:
        momentum = torch.zeros(self.n_params) if self.avg.outer == "nesterov" else None
        return SharedState.create(0, 0, self.params(), momentum)

    def save(self) -> None:
        """Checkpoint the shared state, the AdamW state and the step, atomically, in one file."""
        state = self.replica.state
        tensors = {"params": state.params.contiguous()}
        if state.momentum is not None:
            tensors["momentum"] = state.momentum.contiguous()
        tensors.update(optimizer_tensors(self.opt))
        meta = {"version": json.dumps(state.version.to_wire()), "step": str(self.step), "block": str(self.block),
                "loss": repr(self.loss), "config": self.cfg.to_json()}
        atomic_write(self.path, save_safetensors(tensors, metadata=meta))

    def _resume(self) -> SharedState:
        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
            saved = RunConfig.from_json(meta["config"])
            version = Version(**json.loads(meta["version"]))
            step, block = int(meta["step"]), int(meta["block"])
            loss = float(meta.get("loss", "nan"))  # so a resumed node shows its last loss before its next step
        except (SafetensorError, OSError, KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{self.path} is not a readable worker checkpoint ({exc}); move it away to "
                                  f"start this block from the swarm") from exc
        if block != self.block or not same_run(saved, self.cfg):
            raise CheckpointError(f"{self.path} holds block {block} of another model or noise schedule; give "
                                  f"this node another --out")
        try:
            state = SharedState.unpack(version, SharedState.pack(tensors["params"], tensors.get("momentum")),
                                       self.n_params)
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: {exc}; the file is damaged") from exc
        self.set_params(state.params)
        load_optimizer_tensors(self.opt, tensors)
        self.step, self.loss = step, loss
        log.info("block %d resumed from %s: round %d, step %d, loss %.4f, state %s", self.block, self.path,
                 version.round, step, loss, version.hash[:12])
        return state

    # --- the training loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Train to cfg.train.steps in rounds of `every` local steps, then keep serving the state."""
        if self.fresh:  # a joiner hears the holders' versions and syncs before its first step
            for _ in range(int(JOIN_WAIT_S / 0.1)):
                if self.node.conns:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(JOIN_SETTLE_S)
            fetch = self._settle_fetch()
            if fetch is not None:
                await fetch
                self._adopt_pending()
            self.fresh = False
        t, sends = self.cfg.train, []
        while self.step < t.steps:
            self._adopt_pending()
            n = min(self.avg.every, t.steps - self.step)
            started = self.step
            await asyncio.to_thread(self._train_steps, n)
            self._adopt_pending()
            delta = through_codec(self.params() - self.replica.state.params, CODECS[self.avg.codec], self.compression)
            own = self.replica.submit(delta, (self.step - started) * t.batch, time.monotonic())
            sends = [self.node.spawn(self._send_update(conn, own)) for conn in self.node.peers_holding(self.block)]
            await self._finish_round()
        self.done = True
        self.synced = False  # no more rounds from this node: peers must not wait for it
        await asyncio.gather(*sends, return_exceptions=True)  # (after its last update, not overtaking it)
        await self._announce()
        log.info("block %d: trained %d steps in %d rounds; still serving its state", self.block, self.step,
                 self.replica.counters.rounds)
        while True:  # keep agreeing with the swarm: adopt preferred states peers announce
            await self.changed.wait()
            self.changed.clear()
            self._adopt_pending()

    @property
    def compression(self) -> str:
        return "lz4" if self.avg.lz4 else "none"

    def _train_steps(self, n: int) -> None:
        t = self.cfg.train
        for _ in range(n):
            for group in self.opt.param_groups:
                group["lr"] = learning_rate(self.step, self.cfg)
            windows = random_windows(self.data, t.batch, self.cfg.model.context + 1, self.gen)
            loss, ce = train_step(self.module, self.loss_fn, self.opt, windows, self.gen, t.grad_clip)
            if not math.isfinite(loss):
                raise FloatingPointError(f"block {self.block}: loss became {loss} at step {self.step}; lower --lr")
            self.loss, self.ce = loss, ce
            self.step += 1

    async def _finish_round(self) -> None:
        """Wait for the round to close (peers in, or the deadline), or for a preferred state to adopt."""
        while True:
            self.changed.clear()
            if self.pending is not None and self.replica.wants(self.pending.version):
                self._adopt_pending()  # this round was on the old state; the progress is rebased
                return
            gone = {p for p in self.replica.expected if p not in self.node.conns or self.node.conns[p].closed}
            now = time.monotonic()
            if self.replica.can_close(now, gone):
                waited = now - self.replica.ready_at
                closed = self.replica.close()
                self.history.append({"round": closed.state.version.round - 1, "updates": len(closed.contributors),
                                     "waited_s": round(waited, 3)})
                del self.history[:-HISTORY]
                self.synced = True
                self.set_params(closed.state.params)
                self.save()
                with self.path.with_suffix(".history.jsonl").open("a") as f:  # the loss history, kept whole
                    f.write(json.dumps({**self.history[-1], "step": self.step, "loss": self.loss, "ce": self.ce,
                                        "time": time.time()}) + "\n")
                log.info("block %d round %d closed with %d update(s); state %s", self.block, closed.state.version.round,
                         len(closed.contributors), closed.state.version.hash[:12])
                await self._announce()
                self._settle_fetch()  # a peer may have closed this round differently
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), max(0.01, self.replica.deadline() - now))

    def _adopt_pending(self) -> None:
        state, self.pending = self.pending, None
        if state is None or not self.replica.wants(state.version):
            return
        self.set_params(self.replica.adopt(state, self.params()))
        self.synced = False
        self.save()
        log.info("block %d adopted state %s of round %d (%d samples)", self.block, state.version.hash[:12],
                 state.version.round, state.version.samples)
        self.node.spawn(self._announce())

    # --- messages -----------------------------------------------------------------------------------

    async def _send_update(self, conn: Connection, own: Update) -> None:
        with contextlib.suppress(PeerGone):
            stream = await conn.send_tensor(own.delta, CODECS[self.avg.codec], self.compression)
            await conn.send(messages.Update(block=self.block, round=own.round, base=own.base, samples=own.samples,
                                            stream=stream))

    async def _announce(self) -> None:
        for conn in self.node.peers_holding(self.block):
            await self.on_peer(conn)

    async def on_peer(self, conn: Connection) -> None:
        """Tell a same-block peer which state this node holds."""
        if self.block in conn.hello.blocks:
            with contextlib.suppress(PeerGone):
                await conn.send(messages.Version(block=self.block, **self.replica.state.version.to_wire(),
                                                 synced=self.synced))

    async def on_update(self, conn: Connection, msg: messages.Message) -> None:
        if msg.block != self.block:
            log.warning("update from %s is for block %d; this node trains block %d", conn.label[:8], msg.block,
                        self.block)
            return
        self.replica.offer(Update(conn.label, msg.round, msg.base, msg.samples, msg.tensor))
        self.changed.set()

    async def on_version(self, conn: Connection, msg: messages.Message) -> None:
        if msg.block != self.block:
            return
        self.replica.note_version(conn.label, Version(msg.round, msg.samples, msg.hash), msg.synced)
        self.changed.set()
        if not self.fresh:
            self._settle_fetch()

    def _settle_fetch(self) -> asyncio.Task | None:
        """If a peer holds a preferred state, fetch it from one of its holders, in the background."""
        if self.fetching:
            return None
        best = None
        for version, _ in self.replica.announced.values():
            if self.replica.wants(version, in_round=not self.done) and (best is None or version.preferred_over(best)):
                best = version
        holders = [p for p, (v, _) in self.replica.announced.items() if v == best and p in self.node.conns]
        if best is None or not holders:
            return None
        self.fetching = True
        return self.node.spawn(self._fetch(holders))

    async def _fetch(self, holders: list[str]) -> None:
        try:
            while holders:
                donor = pick_donor(self.node.id, holders)
                holders.remove(donor)
                conn = self.node.conns.get(donor)
                if conn is None:
                    continue
                try:
                    run_cfg, state = await request_state(conn, self.block, self.n_params)
                    if not same_run(run_cfg, self.cfg):
                        raise ValueError("its model or noise schedule differs from this node's")
                except (PeerGone, ProtocolError, ValueError, TypeError) as exc:
                    log.warning("state of block %d from %s refused: %s", self.block, donor[:8], exc)
                    continue
                log.info("block %d: fetched state %s (round %d) from %s", self.block, state.version.hash[:12],
                         state.version.round, donor[:8])
                self.pending = state
                self.changed.set()
                return
        finally:
            self.fetching = False

    async def on_state_get(self, conn: Connection, msg: messages.Message) -> None:
        if msg.block != self.block:
            await conn.send(messages.Error(re=msg.id, code="no_state",
                                           message=f"this node holds block {self.block}, not {msg.block}"))
        elif self.serving >= MAX_SERVING:
            await conn.send(messages.Error(re=msg.id, code="busy", message="try another holder"))
        else:
            self.node.spawn(self._serve_state(conn, msg))

    async def _serve_state(self, conn: Connection, msg: messages.Message) -> None:
        state = self.replica.state  # a snapshot: rounds replace the state object, never mutate it
        self.serving += 1
        try:
            stream = await conn.send_tensor(state.flat(), "raw")
            await conn.send(messages.StateReply(re=msg.id, block=self.block, **state.version.to_wire(), stream=stream,
                                                config=self.cfg.to_dict()))
            self.served += 1
        except PeerGone as exc:
            log.info("state transfer to %s stopped: %s", conn.label[:8], exc)
        finally:
            self.serving -= 1

    # --- status -------------------------------------------------------------------------------------

    def status(self) -> dict:
        v = self.replica.state.version
        # loss: the w(sigma)-weighted DiffusionBlocks loss it minimises; ce: the plain CE of its last batch
        return {"block": self.block, "step": self.step, "steps": self.cfg.train.steps, "loss": self.loss, "ce": self.ce,
                "round": v.round, "version": v.to_wire(), "done": self.done, "served": self.served,
                "counters": self.replica.counters.as_dict(), "averaging": dict(self.avg.__dict__),
                "n_blocks": self.cfg.model.n_blocks, "params": self.n_params, "history": self.history}

    def status_line(self) -> str:
        v = self.replica.state.version
        return (f"block {self.block} step {self.step}/{self.cfg.train.steps} ce {self.ce:.3f} (weighted loss "
                f"{self.loss:.3f}) | round {v.round} "
                f"state {v.hash[:8]}")
