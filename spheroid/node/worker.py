"""A node that trains one block: local steps in a worker thread, then a round with same-block peers.

The round logic lives in spheroid/averaging.py (sans I/O); this module is its asyncio side: it
streams updates to the peers that hold the same block, feeds what arrives into the `Replica`,
closes rounds at their deadline, announces the resulting `Version`, fetches a preferred state from
the peer that announced it (a joiner, a restarted or a diverged replica), serves its own state to
others, and checkpoints after every round (OUT/worker-B.json and the weights file it names and
verifies: parameters, the outer momentum, the AdamW state; the version and the step in the
record) and when the node stops (SIGINT, SIGTERM: after the step under way, with the local
parameters trained since the round, so that a restart resumes at that step). Optimizer state never
leaves the node.

A block that reads the blocks before it keeps its copies of them fresh from their holders
(upstream.py: `Upstream`), and as a holder it keeps the copies it made for its readers
(`ReadersCopies`), so that a refresh by change starts from the copy a reader holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from .. import checkpoint
from ..averaging import UNCONFIRMED, AveragingConfig, Closed, Replica, SharedState, Version, state_hash
from ..checkpoint import CheckpointError
from ..config import REFERENCE_PART, RunConfig, part_name
from ..data import random_windows
from ..resume import load_optimizer_tensors, optimizer_tensors
from ..status import RoundCounters, RoundRecord, TrainingMemory, TrainingStatus
from ..train import (
    costed_step,
    learning_rate,
    make_optimizer,
    memory_mb,
    part_trainer,
    peak_rss_mb,
    reads_earlier,
    train_step,
)
from ..wire import messages, through_codec
from ..wire.tensors import CODEC_OPTIONS
from .averager import Averager
from .connection import Connection, PeerGone
from .node import Node
from .upstream import ReadersCopies, Upstream, fetch_from, peers_of, same_run

log = logging.getLogger(__name__)

# state transfers a holder runs at once, by kind; more requesters are told to try another holder:
# 2 snapshots, and 8 changes from readers' copies (each a codec pass and a fraction of a
# snapshot's bytes; a reader told to try another holder would get a snapshot from it)
MAX_SERVING = {"snapshot": 2, "change": 8}
MAX_JOINERS_WAITING = 8  # same-block peers' requests waiting for this node's averaging round to close
DELTA_CODECS = tuple(o for o, c in CODEC_OPTIONS.items() if c.lossy)  # codecs a holder sends a change since a state in
RECENT = 4  # states a holder keeps, to send a reader the change from the one it holds
HISTORY = 50  # rounds kept in the status
COSTED_STEPS = 32  # first steps whose FLOPs and activations are counted (`costed_step`), for the status
JOIN_WAIT_S = 3.0  # a fresh node waits up to this long for its first peer of its block (`_met_a_peer`),
JOIN_SETTLE_S = 0.5  # then listens this long for versions before it picks a donor


def from_protocol_8(version: Version, params: torch.Tensor, momentum: torch.Tensor | None) -> Version:
    """The version of a checkpoint's state, named by this protocol's hash if it was saved under
    protocol 8, whose hash was the sha256 of the whole state (so a node upgraded over its
    checkpoint resumes from it); any other version as it is."""
    flat = SharedState.pack(params, momentum).detach().to(torch.float32).contiguous()
    if hashlib.sha256(flat.numpy()).hexdigest() != version.hash:
        return version
    return replace(version, hash=state_hash(params, momentum))


class BlockWorker:
    """A node's trainer of one part of the model: block `block`, or with `block` REFERENCE_PART the
    whole end-to-end reference, trained by data-parallel replicas that average their change every
    `every` local steps (DiLoCo-style with `--outer nesterov`): the same rounds, versions, state
    transfers and checkpoints as a block's replicas."""

    def __init__(self, node: Node, cfg: RunConfig, averaging: AveragingConfig, block: int, data: torch.Tensor,
                 out: Path) -> None:
        self.node, self.cfg, self.avg, self.block, self.data = node, cfg, averaging, block, data
        self.reference, self.label = block == REFERENCE_PART, part_name(block)
        # its checkpoint: OUT/worker-B.json (worker-reference.json) and the weights file it names
        self.out, self.name = Path(out), "worker-reference" if self.reference else f"worker-{block}"
        self.legacy = self.out / f"{self.name}.safetensors"  # (one file, as nodes wrote it before)
        # every replica starts from the same genesis state; the earlier blocks it reads, from theirs
        self.module, self.loss_fn, self.earlier = part_trainer(cfg, block, torch.device("cpu"))
        self.reads = reads_earlier(cfg) and not self.reference  # (announce versions to later blocks)
        self.opt = make_optimizer(self.module, cfg)
        self.upstream = Upstream(node, block, self.earlier, cfg.train.refresh_every or averaging.every,
                                 cfg.train.refresh_codec)
        # each replica draws its own batches and noise
        node_seed = int(node.id[:8], 16)
        self.gen = torch.Generator().manual_seed(cfg.train.seed ^ node_seed)
        torch.manual_seed(cfg.train.seed * 7919 + node_seed)
        self.step, self.loss, self.ce = 0, float("nan"), float("nan")
        self.costed, self.flops, self.saved_bytes = 0, 0, 0  # steps counted by `costed_step`, their FLOPs, activations
        self.round_end: int | None = None  # the step this node's round's local steps end at, while it trains them
        # clear while it averages a round: a same-block joiner is answered once it is set again (`on_state_get`)
        self.not_averaging = asyncio.Event()
        self.not_averaging.set()
        self.joiners_waiting = 0
        self.stopping = False  # (set when the node stops: the training thread ends after its current step)
        self.training: asyncio.Future | None = None  # the training thread's chunk of steps under way
        self.round_start: int | None = None  # the step the round being trained (or averaged) started at
        self.saved_step: int | None = None  # the step of the last checkpoint
        # with a state adopted from a holder mid-round: the share of that round's steps it had left
        self.left: float | None = None
        self.n_params = sum(p.numel() for p in self.module.parameters())
        genesis = self.params()  # (readers of this block start from it too: changes since it are sent)
        saved = (self.out / f"{self.name}.json").exists() or self.legacy.exists()
        state = self._resume() if saved else self._genesis()
        self.fresh = state.version.round == 0 and self.step == 0
        # synced: reached its state by a round (or genesis) and still training, not by a fetch, a
        # restart, or done; what it keeps of its own tensors went through the wire codec, as peers see them
        self.replica = Replica(node.id, state, averaging, synced=self.fresh,
                               wire=lambda t: through_codec(t, CODEC_OPTIONS[averaging.codec].name, self.compression))
        # parameters a reader of this block may hold, by their hash: the genesis parameters, this
        # node's last RECENT states' and the copies it made by sending changes
        self.genesis = (state_hash(genesis), (0, genesis))
        self.recent: dict[str, tuple[int, torch.Tensor]] = {}
        self.readers = ReadersCopies()
        self._keep(state)
        self.pending: SharedState | None = None  # a fetched state to adopt between training chunks
        self.fetching = False
        self.serving = {"snapshot": 0, "change": 0}  # transfers under way, of each kind
        self.served = 0
        self.done = False
        self.history: list[dict] = []  # the last rounds: how many updates, how long this node waited
        self.changed = asyncio.Event()
        self.averager = Averager(node, block, self.replica, averaging.codec, self.compression, self.changed)
        node.handlers.update(version=self.on_version, state_get=self.on_state_get)
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

    def _keep(self, state: SharedState) -> None:
        """Remember a state this node held (rounds replace the state's tensors, never change them)."""
        key = state.version.hash if state.momentum is None else state_hash(state.params)
        self.recent[key] = (state.version.round, state.params)
        while len(self.recent) > RECENT:
            del self.recent[next(iter(self.recent))]

    def save(self) -> None:
        """Checkpoint the shared state, the AdamW state and the step, atomically, as any checkpoint
        (spheroid/checkpoint.py: a JSON record with the configuration, and the tensors it verifies).
        Parameters of its own beside the state's (the steps trained since the round, as when the node
        stops, or progress a round did not average) go as "local", and the step its round started at
        as "since": `_resume` restores them (and a node without them, the state as it is)."""
        state, local = self.replica.state, self.params()
        tensors = {"params": state.params.contiguous()}
        if state.momentum is not None:
            tensors["momentum"] = state.momentum.contiguous()
        tensors.update(optimizer_tensors(self.opt))
        record = {"version": state.version.to_wire(), "step": self.step, "block": self.block, "loss": self.loss,
                  "reads": self.upstream.status().reads}
        if not torch.equal(local, state.params):
            tensors["local"] = local
            record["since"] = self.step if self.round_start is None else self.round_start
        checkpoint.save_tensors(self.out, self.name, tensors, self.cfg, record)  # (and the legacy file goes)
        self.saved_step = self.step

    def _saved(self) -> tuple[RunConfig, dict, dict[str, torch.Tensor], bool]:
        """The saved configuration, record and tensors, and whether the file was verified: from the
        JSON record (everything verified by sha256), or from a checkpoint of one file with its record
        in the metadata, as nodes wrote it before."""
        if (self.out / f"{self.name}.json").exists():
            entry = checkpoint.load(self.out, self.name)
            return entry.config, entry.state, entry.tensors, True
        try:
            with safe_open(str(self.legacy), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
            record = {"version": json.loads(meta["version"]), "step": int(meta["step"]),
                      "block": int(meta["block"]), "loss": float(meta.get("loss", "nan"))}
            return RunConfig.from_json(meta["config"]), record, tensors, False
        except (SafetensorError, OSError, KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{self.legacy} is not a readable worker checkpoint ({exc}); move it away to "
                                  f"start this block from the swarm") from exc

    def _resume(self) -> SharedState:
        saved, record, tensors, verified = self._saved()
        try:
            version = Version(**record["version"])
            step, block = int(record["step"]), int(record["block"])
            loss = float(record.get("loss", math.nan))  # so a resumed node shows its last loss before its next step
            since = min(step, int(record.get("since", step)))  # (the step its round started at, if it stopped in one)
        except (KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{self.out}/{self.name}: a malformed record ({exc}); move it away to start this "
                                  f"block from the swarm") from exc
        if block != self.block or not same_run(saved, self.cfg):
            raise CheckpointError(f"{self.out}/{self.name} holds block {block} of another model or noise schedule; "
                                  f"give this node another --out")
        try:
            params, momentum = tensors["params"], tensors.get("momentum")
            version = from_protocol_8(version, params, momentum)
            if verified and (actual := state_hash(params, momentum)) != version.hash:
                # (the file checked out, so not damage: the round agreed on a hash that is not its state's,
                # as when an owner's leaf digests were wrong; the version rule settles which state is kept)
                log.warning("%s's checkpoint records state %s but holds state %s; resuming under the "
                            "latter", self.label, version.hash[:12], actual[:12])
                version = replace(version, hash=actual)
            state = SharedState.unpack(version, SharedState.pack(params, momentum), self.n_params)
        except (KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{self.out}/{self.name}: {exc}; the file is damaged") from exc
        local = tensors.get("local")  # (its own parameters: the steps trained since the state, saved as it stopped)
        if local is not None and local.shape != state.params.shape:
            raise CheckpointError(f"{self.out}/{self.name}: its local parameters are {tuple(local.shape)}, not "
                                  f"{tuple(state.params.shape)}; the file is damaged")
        self.set_params(state.params if local is None else local)
        load_optimizer_tensors(self.opt, tensors)
        self.step, self.loss, self.saved_step = step, loss, step
        if since < step:  # mid-round: it trains the rest of it, and its update counts the samples since its start
            self.round_start, self.left = since, max(0, since + self.avg.every - step) / self.avg.every
        log.info("%s resumed from %s: round %d, step %d, loss %.4f, state %s%s", self.label, self.out, version.round,
                 step, loss, version.hash[:12], "" if local is None else f", its own parameters "
                 f"{state_hash(self.params())[:12]} ({step - since} steps since the round's start)")
        return state

    # --- the training loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Train to cfg.train.steps in rounds of `every` local steps, then keep serving the state. When
        the node stops (SIGINT, SIGTERM: it cancels this), what was trained is saved first."""
        try:
            await self._train()
        except asyncio.CancelledError:
            await self._save_on_stop()
            raise

    async def _save_on_stop(self) -> None:
        """Let the training thread end its current step, then checkpoint the step and the parameters
        trained since the round's state (`save`): a restart resumes at this very step (unsaved, a node
        stopped at step 63 resumed at 60). Stopped while averaging, those steps went out as its update
        and are not kept (`_train`). Nothing is written if nothing was trained since the last
        checkpoint, or if the step under way failed."""
        self.stopping = True
        if self.training is not None and isinstance((await asyncio.gather(self.training, return_exceptions=True))[0],
                                                    BaseException):
            return
        if self.step != self.saved_step and self.step > 0:
            self.save()
            log.info("%s stopped at step %d: saved to %s", self.label, self.step, self.out)

    async def _train(self) -> None:
        if self.fresh or self.earlier:  # hear the holders' versions, and sync, before the first step
            for _ in range(int(JOIN_WAIT_S / 0.1)):
                if self._met_a_peer():
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(JOIN_SETTLE_S)
            # (the earlier blocks' fetch: started now, or already by an announcement meanwhile)
            fetches = [task for task in (self._settle_fetch() if self.fresh else None,
                                         self.upstream.refresh(self.step) or self.upstream.fetching)
                       if task is not None]
            await asyncio.gather(*fetches)
            self._adopt_pending()
            self._settle_fetch()  # (a version heard after the first look, as on a loaded machine)
            self.fresh = False
        t = self.cfg.train
        while self.step < t.steps:
            self._adopt_pending()
            # (resumed in a round: the step it started at, `_resume`)
            started = self.round_start = self.step if self.round_start is None else self.round_start
            await self._train_round()
            self.not_averaging.clear()
            try:
                closed = await self.averager.round(self.params() - self.replica.state.params,
                                                   (self.step - started) * t.batch, self._preferred_pending)
            except asyncio.CancelledError:  # (stopping: its steps went out as its update; none kept, `_save_on_stop`)
                self.set_params(self.replica.state.params)
                raise
            finally:
                self.not_averaging.set()
            self.round_start = None
            if closed is None:
                self._adopt_pending()  # this round was on the old state; the progress is rebased
            else:
                await self._closed(closed, self.step - started)
        self.done = True
        # no more rounds from this node: peers that hear it before their next round leave it out of the
        # one after (the next waits for it until its deadline: its group is counted already)
        self.replica.synced = False
        await self.averager.flush()  # (after its last update, not overtaking it)
        await self._announce()
        log.info("%s: trained %d steps in %d rounds; still serving its state", self.label, self.step,
                 self.replica.counters.rounds)
        while True:  # keep agreeing with the swarm: adopt preferred states peers announce
            await self.changed.wait()
            self.changed.clear()
            self._adopt_pending()

    def _met_a_peer(self) -> bool:
        """Whether a peer worth hearing before the first step is connected: for a fresh node, one of
        its own block, whose version it may start from (a node of another block, met first, says
        nothing of that: started then, a fresh node trained alone from genesis, all of a short run
        before its block's other replica had come up); for a node that only reads earlier blocks,
        any peer."""
        return any(not self.fresh or self.block in conn.hello.blocks for conn in self.node.conns.values())

    @property
    def compression(self) -> str:
        return "lz4" if self.avg.lz4 else "none"

    async def _train_round(self) -> None:
        """Train this round's local steps (`_round_steps`). A preferred state fetched meanwhile is
        adopted at once, this node's progress rebased onto it; then, if its holder was training, this
        node trains the share of that round the holder had left, so that its update comes with the
        holder's; else its update goes now. (Trained to the end on the old state, it would come
        after the holder's round had closed without it.)"""
        started, n = self.step, self._round_steps()
        while n > 0:
            n = min(n, self.cfg.train.steps - self.step)
            self.round_end = self.step + n
            # (shielded: when the node stops, the thread ends after its current step, and `_save_on_stop` waits for it)
            self.training = asyncio.ensure_future(asyncio.to_thread(self._train_steps, n))
            await asyncio.shield(self.training)
            self.training = None
            self.round_end = None
            adopted = self._adopt_pending()
            # (stopped before its first step: a round has one at least, and an update samples)
            n = self._round_steps() if (adopted and self.left is not None) or self.step == started else 0
        self.left = None

    def _round_steps(self) -> int:
        """This round's local steps: `every`; or, on a state just fetched from a holder that was
        training, the share of them it had left, so that this node's parts come with the holder's
        round's (a whole round would make them a round late, and every round after too)."""
        left, self.left = self.left, None
        return self.avg.every if left is None else max(1, math.ceil(self.avg.every * left))

    def left_in_round(self) -> float | None:
        """The share of its round's local steps this node has still to train; None if it is not
        training (averaging, or done)."""
        if self.round_end is None:
            return None
        return min(1.0, max(0.0, (self.round_end - self.step) / self.avg.every))

    def _train_steps(self, n: int) -> None:
        """Up to n steps (in a thread); fewer if a preferred state is fetched meanwhile."""
        t = self.cfg.train
        for _ in range(n):
            if self.stopping or self._preferred_pending():
                return
            if self.upstream.pending:  # (a fresher copy of an earlier block, fetched meanwhile)
                self.upstream.apply()
            for group in self.opt.param_groups:
                group["lr"] = learning_rate(self.step, self.cfg)
            windows = random_windows(self.data, t.batch, self.cfg.model.context + 1, self.gen)
            if self.costed < COSTED_STEPS:  # (a block's steps differ by the chain level drawn: a mean)
                loss, ce, cost = costed_step(self.module, self.loss_fn, self.opt, windows, self.gen, t.grad_clip)
                self.costed, self.flops = self.costed + 1, self.flops + cost.flops
                self.saved_bytes = max(self.saved_bytes, cost.saved_bytes)
            else:
                loss, ce = train_step(self.module, self.loss_fn, self.opt, windows, self.gen, t.grad_clip)
            if not math.isfinite(loss):
                raise FloatingPointError(f"{self.label}: loss became {loss} at step {self.step}; lower --lr")
            self.loss, self.ce = loss, ce
            self.step += 1

    def _heard(self) -> tuple[set[str], float]:  # (what trusting a version reads: the block's peers there, the time)
        return peers_of(self.node, self.block), time.monotonic()

    def _preferred_pending(self) -> bool:  # (and trusted: where its values are checked, they were as it came)
        return self.pending is not None and self.replica.takes(self.pending.version, *self._heard())

    async def _closed(self, closed: Closed, steps: int) -> None:
        """After a round of `steps` local steps: the new state, checkpointed, logged, announced; then
        what peers may have."""
        waited = time.monotonic() - closed.ready_at
        self.history.append({"round": closed.state.version.round - 1, "updates": len(closed.contributors),
                             "steps": steps, "waited_s": round(waited, 3)})
        del self.history[:-HISTORY]
        local = closed.state.params if closed.carry is None else closed.state.params + closed.carry
        self.set_params(local)  # (carry: this node's progress that was not averaged)
        self._keep(closed.state)
        self.save()
        with (self.out / f"{self.name}.history.jsonl").open("a") as f:  # the loss history, kept whole
            f.write(json.dumps({**self.history[-1], "step": self.step, "loss": self.loss, "ce": self.ce,
                                "time": time.time()}) + "\n")
        log.info("%s round %d closed with %d update(s); state %s", self.label, closed.state.version.round,
                 len(closed.contributors), closed.state.version.hash[:12])
        await self._announce()
        self._settle_fetch()  # a peer may have closed this round differently
        self.upstream.refresh(self.step)

    def _adopt_pending(self) -> bool:
        """Rebase onto the state fetched meanwhile, if it is still preferred and trusted; whether it was."""
        self.upstream.apply()
        state, self.pending = self.pending, None
        verdict = "none" if state is None else self.replica.vet(state, *self._heard())
        if verdict is not None:
            self.pending = state if verdict == UNCONFIRMED else None  # (its holders may yet confirm it: `Replica.vet`)
            return False
        self.set_params(self.replica.adopt(state, self.params()))
        self._keep(state)
        self.save()
        self.left = state.left
        log.info("%s adopted state %s of round %d (%d samples%s)", self.label, state.version.hash[:12],
                 state.version.round, state.version.samples,
                 "" if state.left is None else f"; its holder had {state.left:.0%} of that round's steps left")
        self.node.spawn(self._announce())
        return True

    # --- messages -----------------------------------------------------------------------------------

    @property
    def joining(self) -> bool:
        """Training, but not a member of the next round's group: it sends its parts to one row."""
        return not self.replica.synced and not self.done

    async def _announce(self) -> None:
        for conn in list(self.node.conns.values()):
            await self.on_peer(conn)
        if self.joining:  # also to the row it sends its parts to, connected or not, so it is waited for
            self.node.spawn(self._announce_to_row())

    async def _announce_to_row(self) -> None:
        rows = [p for p in self.replica.row_peers() if p not in self.node.conns]
        for conn in await asyncio.gather(*(self.node.reach(p) for p in rows)):
            if conn is not None:
                await self.on_peer(conn)

    async def on_peer(self, conn: Connection) -> None:
        """Tell a same-block peer which state this node holds, and a peer of a later block that reads it."""
        readers = self.reads and any(self.block < b < self.cfg.model.n_blocks for b in conn.hello.blocks)
        if self.block in conn.hello.blocks or readers:
            with contextlib.suppress(PeerGone):
                await conn.send(messages.Version(block=self.block, **self.replica.state.version.to_wire(),
                                                 synced=self.replica.synced, joining=self.joining or None))

    async def on_version(self, conn: Connection, msg: messages.Message) -> None:
        if msg.block < self.block:
            self.upstream.note(conn.label, msg.block, Version(msg.round, msg.samples, msg.hash))
            if not self.fresh:  # (a fresh node fetches its first copies itself, before its first step)
                self.upstream.refresh(self.step)
        if msg.block != self.block:
            return
        version = Version(msg.round, msg.samples, msg.hash)
        self.replica.note_version(conn.label, version, msg.synced, bool(msg.joining))
        self.changed.set()
        if not self.fresh and self.replica.wants(version, in_round=not self.done):  # (else nothing new to fetch)
            self._settle_fetch()

    def _settle_fetch(self) -> asyncio.Task | None:
        """If a peer holds a preferred state this node may trust, fetch it from a holder, in the background."""
        if self.fetching:
            return None
        in_round = not (self.done or self.fresh)  # (a node yet to train its first step is in no round)
        best = self.replica.choice(in_round, *self._heard())
        holders = [p for p, (v, _) in self.replica.announced.items() if v == best and p in self.node.conns]
        if best is None or not holders:
            return None
        self.fetching = True
        return self.node.spawn(self._fetch(holders))

    async def _fetch(self, holders: list[str]) -> None:
        try:
            got = await fetch_from(self.node, holders, self.block, self.n_params, self.cfg)
            if got is not None and self.replica.vet(got[1], *self._heard()) in (None, UNCONFIRMED):  # (else refused)
                _, self.pending = got
                self.changed.set()
        finally:
            self.fetching = False

    async def on_state_get(self, conn: Connection, msg: messages.Message) -> None:
        if msg.block != self.block:
            await conn.send(messages.Error(re=msg.id, code="no_state",
                                           message=f"this node holds {self.label}, not {part_name(msg.block)}"))
            return
        if (self.block in conn.hello.blocks and not self.not_averaging.is_set()
                and self.joiners_waiting < MAX_JOINERS_WAITING):
            self.joiners_waiting += 1  # (counted now, as below)
            self.node.spawn(self._serve_after_round(conn, msg))
            return
        await self._serve(conn, msg)

    async def _serve(self, conn: Connection, msg: messages.Message) -> None:
        """Stream the state in a task of its own if a transfer of its kind may start; else say busy."""
        kind = self._serves(msg)
        if self.serving[kind] >= MAX_SERVING[kind]:
            await conn.send(messages.Error(re=msg.id, code="busy", message="try another holder"))
        else:
            self.serving[kind] += 1  # (counted now: requests in one read are handled before the task runs)
            self.node.spawn(self._serve_state(conn, msg, kind))

    async def _serve_after_round(self, conn: Connection, msg: messages.Message) -> None:
        """Answer a same-block peer once this node's averaging round has closed. Served now, a joiner
        would get the state of a round about to close, with none of its steps left to train: trained
        whole on it, its first update would come after that round had closed, and it would end that
        round on a state of its own and fetch again. Served after, it gets the state the next round
        starts from, which it trains with this node. It waits at most the round's deadline and a
        second, and 0.8 of the shorter of the request's `within` (how long the requester waits for
        the reply; ignored unless a positive number) and this node's own timeout; past that it is
        served the state as it is, and not at all if it has gone meanwhile."""
        patience = self.node.cfg.timeout
        if msg.within is not None and 0.0 < msg.within < patience:  # (also refuses NaN)
            patience = msg.within
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(self.avg.wait + 1.0, 0.8 * patience)):
                    await self.not_averaging.wait()
        finally:
            self.joiners_waiting -= 1
        if not conn.closed:
            await self._serve(conn, msg)

    def _serves(self, msg: messages.Message) -> str:
        """What a state request will most likely get: a change, if it names parameters this node
        knows in a codec for changes, else a snapshot."""
        known = msg.since in self.recent or msg.since == self.genesis[0] or self.readers.knows(msg.since)
        return "change" if msg.codec in DELTA_CODECS and known else "snapshot"

    async def _serve_state(self, conn: Connection, msg: messages.Message, kind: str) -> None:
        """Stream this node's state; or, asked in a lossy codec for the change from parameters it
        knows, that change (parameters only: a reader has no use for the outer momentum), keeping
        the copy it makes so that the next change starts from it. (`serving[kind]` counts it already.)"""
        state = self.replica.state  # a snapshot: rounds replace the state object, never mutate it
        members = self.replica.members()  # (the group of the round that starts from it)
        try:
            change = None
            if msg.codec in DELTA_CODECS:  # (off the event loop: a codec pass and a hash of the block)
                known = {**self.recent, self.genesis[0]: self.genesis[1]}
                change = await asyncio.to_thread(self.readers.change, msg.since, known, state.params,
                                                 state.version.round, CODEC_OPTIONS[msg.codec].name)
            if change is None:
                if kind == "change":  # (the copy was forgotten meanwhile: a snapshot after all, if one may go)
                    self.serving["change"] -= 1
                    kind = "snapshot"
                    self.serving[kind] += 1
                    if self.serving[kind] > MAX_SERVING[kind]:
                        await conn.send(messages.Error(re=msg.id, code="busy", message="try another holder"))
                        return
                stream = await conn.send_tensor(state.flat(), "raw")
            else:
                stream = await conn.send_tensor(*change, "lz4")
            # (as the reply goes: after the stream, how much of the state's round is left to train)
            left = self.left_in_round() if state is self.replica.state else None
            await conn.send(messages.StateReply(re=msg.id, block=self.block, **state.version.to_wire(), stream=stream,
                                                config=self.cfg.to_dict(), since=None if change is None else msg.since,
                                                members=members if change is None else None,
                                                left=left if change is None else None))
            self.served += 1
        except PeerGone as exc:
            self.node.quiet.log(logging.INFO, "transfer stopped", "state transfer to %s stopped: %s", conn.label[:8],
                                exc)
        finally:
            self.serving[kind] -= 1

    # --- status -------------------------------------------------------------------------------------

    def status(self) -> TrainingStatus:
        v = self.replica.state.version
        # loss: the w(sigma)-weighted DiffusionBlocks loss it minimises; ce: the plain CE of its last batch
        return TrainingStatus(
            block=self.block, step=self.step, steps=self.cfg.train.steps, loss=self.loss, ce=self.ce, round=v.round,
            version=v, done=self.done, served=self.served, counters=RoundCounters(**self.replica.counters.as_dict()),
            averaging=self.avg, n_blocks=self.cfg.model.n_blocks, params=self.n_params,
            history=tuple(RoundRecord(**h) for h in self.history), earlier=self.upstream.status(),
            part="reference" if self.reference else "block", **self.costs())

    def costs(self) -> dict:
        """Compute and memory: FLOPs per step (the mean of the first COSTED_STEPS, torch's counter),
        FLOPs of all steps trained, training memory by kind (MiB) and the process's peak RSS."""
        per_step = self.flops / self.costed if self.costed else 0.0
        frozen = self.earlier.blocks if self.earlier else ()
        return {"flops_per_step": per_step, "train_flops": per_step * self.step, "peak_rss_mb": peak_rss_mb(),
                "memory_mb": TrainingMemory(**memory_mb(self.module, self.opt, self.saved_bytes, frozen))}

    def status_line(self) -> str:
        v = self.replica.state.version
        return (f"{self.label} step {self.step}/{self.cfg.train.steps} ce {self.ce:.3f} (weighted loss "
                f"{self.loss:.3f}) | round {v.round} "
                f"state {v.hash[:8]}")
