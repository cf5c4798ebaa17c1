"""Training loops for one block and for the end-to-end reference, and evaluation of checkpoints.

Both trainers share one loop (`fit`): random byte windows, AdamW with warm-up and cosine decay,
gradient clipping, progress logs and periodic checkpoints. They differ only in the loss. A block
trainer trains exactly one block; it may read frozen copies of the blocks before it (chain states,
the relay channel), forward only, and no gradient ever crosses a block boundary. Models are loaded
from checkpoint folders by loading.py; the state a run resumes from is resume.py's.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as fn
from torch.nn.utils import vector_to_parameters
from torch.utils.flop_counter import FlopCounterMode

from . import checkpoint
from .chain import BoundScore, ChainScore, Streams, chain_state, encode_context, score, score_block_alone, score_bound
from .config import REFERENCE_PART, NoiseConfig, RunConfig
from .data import random_windows
from .loading import Chain, block_from, load_chain, load_reference, load_state
from .model import CleanStream, DiffusionBlock, Reference, inherit, make_codebook, parameter_count
from .noise import loss_weight, sample_sigma, sigma_grid, training_band
from .progress import Progress, duration
from .resume import Interrupted, load_resume, logged_step, save_resume

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Generator], tuple[torch.Tensor, float]]


def pick_device(name: str | None = None) -> torch.device:
    """The device to run on: the one named, else cuda when present, else cpu."""
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def learning_rate(step: int, cfg: RunConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak rate."""
    t = cfg.train
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    progress = (step - t.warmup) / max(1, t.steps - t.warmup)
    return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms or position tables' rows)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.endswith("pos_emb")]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not n.endswith("pos_emb"))]
    t = cfg.train
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))


def block_loss(block: DiffusionBlock, cfg: RunConfig, index: int, codebook: torch.Tensor,
               earlier: list[DiffusionBlock] = ()) -> LossFn:
    """The DiffusionBlocks loss of one block: weighted CE of head(D) over its widened noise band.

    With the relay channel the frozen `earlier` blocks compute the clean streams it starts from."""
    lo, hi = training_band(cfg.noise, cfg.model.n_blocks, index)
    chunk = chunk_sampler(cfg)

    def loss(windows: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, float]:
        x, y = windows[:, :-1], windows[:, 1:]  # (B, T)
        k = chunk(gen)
        start, n = noisy_span(cfg, x.shape[1], gen)
        sigma = sample_sigma(cfg.noise, lo, hi, x.shape[0], gen).to(x.device)  # one level per sequence
        eps = torch.randn(x.shape[0], n, codebook.shape[1], device=x.device)  # global RNG, seeded per run
        z = codebook[y[:, start : start + n]] + sigma[:, None, None] * eps  # (B, n, d)
        own = CleanStream(len(block.net.layers))
        with autocast(x.device):
            streams = encode_context(earlier, x) if block.reads_relay else {}
            logits = block(x, z, sigma, start, k, stream=own, previous=streams.get(index - 1))
            relay = relay_ce(block, own, y)
        ce = fn.cross_entropy(logits.float().transpose(1, 2), y[:, start : start + n], reduction="none").mean(dim=1)
        return (loss_weight(sigma, cfg.noise.sigma_data) * ce).mean() + cfg.model.relay_loss * relay, ce.mean().item()

    return loss


def chain_state_loss(block: DiffusionBlock, cfg: RunConfig, index: int, codebook: torch.Tensor,
                     earlier: list[DiffusionBlock]) -> LossFn:
    """CE of block `index` on the states the chain actually reaches (block_input = "chain").

    Each batch picks one of the grid levels this block reads at inference (its own steps, and the
    final read-off at sigma_min for the last block), runs the chain from pure noise up to that level
    with the frozen earlier blocks (and this block's own earlier steps), without gradients, and
    trains this block to predict the bytes from there. No gradient crosses a block boundary.
    """
    spb, n_blocks = cfg.noise.steps_per_block, cfg.model.n_blocks
    levels = list(range(index * spb, (index + 1) * spb)) + ([n_blocks * spb] if index == n_blocks - 1 else [])
    grid = sigma_grid(cfg.noise, n_blocks).tolist()
    stack = [*earlier, block]
    chunk = chunk_sampler(cfg)

    def loss(windows: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, float]:
        x, y = windows[:, :-1], windows[:, 1:]
        level = levels[int(torch.randint(len(levels), (1,), generator=gen))]
        k = chunk(gen)  # the chain runs, and this block trains, under the chunk mask of one K
        start, n = noisy_span(cfg, x.shape[1], gen)
        streams: Streams = {}
        with autocast(x.device):
            z = chain_state(stack, cfg.noise, codebook, x, n, None, steps=level, start=start, chunk=k, streams=streams)
            if block.reads_relay:  # the frozen blocks' streams, also where the chain has not run them
                encode_context(earlier, x, streams)
            sigma = torch.full((x.shape[0],), grid[level], device=x.device)
            own = CleanStream(len(block.net.layers))  # its own stream, with gradient
            logits = block(x, z.float(), sigma, start, k, stream=own, previous=streams.get(index - 1))
            relay = relay_ce(block, own, y)
        ce = fn.cross_entropy(logits.float().transpose(1, 2), y[:, start : start + n])
        return ce + cfg.model.relay_loss * relay, ce.item()

    return loss


def chunk_sampler(cfg: RunConfig) -> Callable[[torch.Generator], int]:
    """The chunk size K of each batch: the model's, or one drawn from train.chunks (mixed K)."""
    chunks = cfg.train.chunks or (cfg.model.chunk,)  # (RunConfig keeps them within the context)
    return lambda gen: chunks[int(torch.randint(len(chunks), (1,), generator=gen))] if len(chunks) > 1 else chunks[0]


def noisy_span(cfg: RunConfig, length: int, gen: torch.Generator) -> tuple[int, int]:
    """(start, n): the positions of a batch's noisy tokens. All of them, or with train.noisy_positions
    N one aligned segment of N, drawn from `gen` (which is then not touched otherwise)."""
    n = cfg.train.noisy_positions
    if not n or n >= length:
        return 0, length
    return n * int(torch.randint(length // n, (1,), generator=gen)), n


def relay_ce(block: DiffusionBlock, stream: CleanStream, y: torch.Tensor) -> torch.Tensor:
    """The relay loss's next-byte CE on the clean stream a block hands on (0 where it hands on nothing
    trained): greedy, layer-wise training of the stack's clean streams, no gradient across blocks."""
    logits = block.relay_logits(stream)
    if logits is None:
        return torch.zeros((), device=y.device)
    return fn.cross_entropy(logits.float().transpose(1, 2), y)


def reference_loss(model: Reference) -> LossFn:
    """Next-byte CE of the end-to-end reference."""

    def loss(windows: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, float]:
        with autocast(windows.device):
            logits = model(windows[:, :-1])
        ce = fn.cross_entropy(logits.float().transpose(1, 2), windows[:, 1:])
        return ce, ce.item()

    return loss


def autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA; a no-op context on the CPU, where fp32 is faster for these sizes."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@dataclass
class FitResult:
    wall_s: float
    flops_per_step: int
    final_loss: float
    final_ce: float
    peak_rss_mb: float
    rss_before_training_mb: float
    peak_gpu_mb: float  # torch's peak allocated device memory; 0 on the CPU
    params: int  # of the model trained (not of the frozen blocks it reads)
    memory: dict[str, float]  # training memory by kind (`memory_mb`), MiB


def fit(
    model: torch.nn.Module,
    loss_fn: LossFn,
    cfg: RunConfig,
    data: torch.Tensor,
    name: str,
    out: Path,
    state_extra: dict | None = None,
    save_every: int = 0,
    log_every: int = 50,
    after_step: Callable[[int, float], None] | None = None,
    resume_every: int = 200,
    stop: threading.Event | None = None,
    frozen: Sequence[torch.nn.Module] = (),
) -> FitResult:
    """Train `model` for cfg.train.steps on random windows of `data`; checkpoint into `out`.

    The run can be resumed: every `resume_every` steps, when `stop` is set (then it raises
    Interrupted) and at the end, it saves its whole state (`save_resume`); a later call with the same
    `out` and configuration continues from there and ends on the weights an uninterrupted run ends
    on. Every `save_every` steps a snapshot goes to out/steps/<step>/ (for learning curves); the
    final weights go to out/; every log line also goes to out/<name>.history.jsonl. FLOPs of one
    step are counted once, at the first step, by torch's counter, and so are the activations it
    keeps for backward (`costed_step`); `frozen` are the modules it runs forward only (a block's
    earlier blocks), counted in its training memory. `after_step(done, loss)` runs after every step
    (a block trainer publishes and refreshes there).
    """
    device = next(model.parameters()).device
    t = cfg.train
    gen = torch.Generator().manual_seed(t.seed)
    opt = make_optimizer(model, cfg)
    rss_before = peak_rss_mb()
    resumed = load_resume(out, name, model, opt, gen, cfg) or {}
    # blocks trained in order read fixed earlier blocks: resuming on others would mix two trainings
    read, reads = resumed.get("reads") or {}, (state_extra or {}).get("reads") or {}
    if resumed and not t.refresh_every and read != reads:
        changed = sorted(k for k in {*read, *reads} if read.get(k) != reads.get(k))
        raise checkpoint.CheckpointError(
            f"{out} holds a resumable {name} trained against other versions of {', '.join(changed)} than the folder "
            f"holds now: --fresh to train {name} again on these, or restore the ones it read")
    first, flops_per_step = resumed.get("step", 0), resumed.get("flops_per_step", 0)
    saved_bytes = resumed.get("saved_bytes", 0)
    loss_value, ce_value = resumed.get("loss", float("nan")), resumed.get("ce", float("nan"))
    spent = resumed.get("wall_s", 0.0)  # seconds of training before this run
    if first >= t.steps and (out / f"{name}.json").exists():
        log.info("%s: already trained to step %d in %s (--fresh starts over)", name, first, out)
        return FitResult(spent, flops_per_step, loss_value, ce_value, peak_rss_mb(), rss_before, 0.0,
                         parameter_count(model), memory_mb(model, opt, saved_bytes, frozen))
    if first:
        log.info("%s: resumed from %s at step %d/%d, loss %.4f", name, out, first, t.steps, loss_value)
    history = out / f"{name}.history.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    if not first:
        history.write_text("")
    elif history.exists():  # steps logged after the state resumed from are trained again: their lines go
        kept = [line for line in history.read_text().splitlines() if logged_step(line) <= first]
        checkpoint.atomic_write(history, "".join(line + "\n" for line in kept).encode())
    started = time.monotonic()
    last_log, last_step = started, first

    def state(done: int) -> dict:
        return {"step": done, "loss": loss_value, "ce": ce_value, "flops_per_step": flops_per_step,
                "saved_bytes": saved_bytes, "wall_s": spent + time.monotonic() - started, **(state_extra or {})}

    for step in range(first, t.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, cfg)
        windows = random_windows(data, t.batch, cfg.model.context + 1, gen).to(device)
        if not flops_per_step:
            loss, ce_value, cost = costed_step(model, loss_fn, opt, windows, gen, t.grad_clip)
            flops_per_step, saved_bytes = cost.flops, cost.saved_bytes
        else:
            loss, ce_value = train_step(model, loss_fn, opt, windows, gen, t.grad_clip)
        loss_value = loss
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"{name}: loss became {loss_value} at step {step}; lower --lr")
        done = step + 1
        if done % log_every == 0 or done == t.steps:
            now = time.monotonic()
            rate = (done - last_step) * t.batch * cfg.model.context / max(now - last_log, 1e-9)
            eta = (t.steps - done) * (now - started) / (done - first)
            log.info("%s step %d/%d loss %.4f ce %.4f lr %.2e %.0f bytes/s, eta %s",
                     name, done, t.steps, loss_value, ce_value, learning_rate(step, cfg), rate, duration(eta))
            with history.open("a") as f:
                f.write(json.dumps({"step": done, "loss": loss_value, "ce": ce_value, "lr": learning_rate(step, cfg),
                                    "bytes_per_s": rate, "wall_s": spent + now - started}) + "\n")
            last_log, last_step = now, done
        if save_every and done % save_every == 0 and done < t.steps:
            checkpoint.save(out / "steps" / f"{done:06d}", name, model, cfg, state(done))
        if after_step:
            after_step(done, loss_value)
        if stop is not None and stop.is_set() and done < t.steps:
            save_resume(out, name, model, opt, gen, cfg, state(done))
            raise Interrupted(done, out)
        if resume_every and done % resume_every == 0 and done < t.steps:
            save_resume(out, name, model, opt, gen, cfg, state(done))
    final = state(t.steps)
    checkpoint.save(out, name, model, cfg, final)
    save_resume(out, name, model, opt, gen, cfg, final)  # a rerun knows it is done
    gpu = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    return FitResult(final["wall_s"], flops_per_step, loss_value, ce_value, peak_rss_mb(), rss_before, gpu,
                     parameter_count(model), memory_mb(model, opt, saved_bytes, frozen))


def train_step(
    model: torch.nn.Module, loss_fn: LossFn, opt: torch.optim.Optimizer, windows: torch.Tensor,
    gen: torch.Generator, grad_clip: float,
) -> tuple[float, float]:
    loss, ce = loss_fn(windows, gen)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return loss.item(), ce


@dataclass(frozen=True)
class StepCost:
    """What one training step cost, as torch counted it."""

    flops: int  # forward and backward (and the frozen earlier blocks' forward passes), torch's counter
    saved_bytes: int  # tensors autograd kept for backward (the step's activations), each storage once


def kept_for_backward(compute: Callable[[], Any]) -> tuple[Any, int]:
    """Run `compute()`; its result and the bytes of the tensors autograd saved for backward, each
    storage counted once."""
    kept: list[torch.Tensor] = []  # held until counted, so that no storage's address is reused meanwhile

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compute()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    return out, sum(storages.values())


def costed_step(
    model: torch.nn.Module, loss_fn: LossFn, opt: torch.optim.Optimizer, windows: torch.Tensor,
    gen: torch.Generator, grad_clip: float,
) -> tuple[float, float, StepCost]:
    """`train_step`, counting its FLOPs and the activations it keeps for backward (slower: for the
    first steps of a run, not all of them)."""
    with FlopCounterMode(display=False) as counter:
        (loss, ce), saved = kept_for_backward(lambda: loss_fn(windows, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
    return loss.item(), ce, StepCost(counter.get_total_flops(), saved)


def memory_mb(model: torch.nn.Module, opt: torch.optim.Optimizer, saved_bytes: int,
              frozen: Sequence[torch.nn.Module] = ()) -> dict[str, float]:
    """A trainer's training memory by kind, in MiB: weights, gradients, optimizer state (AdamW's
    moments), activations kept for backward (`saved_bytes`, from `costed_step`) and the frozen
    copies of earlier blocks it runs forward only; `total` is their sum."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values()
                  if torch.is_tensor(t) and t.dim() > 0)
    held = sum(p.numel() * p.element_size() for module in frozen for p in module.parameters())
    parts = {"weights": params, "gradients": params, "optimizer": moments, "activations": saved_bytes,
             "frozen": held}
    mib = {k: v / 2**20 for k, v in parts.items()}
    return {**mib, "total": sum(mib.values())}


def genesis_block(cfg: RunConfig, index: int) -> DiffusionBlock:
    """Block `index` as it starts: seeded, so every trainer and replica builds the same one."""
    torch.manual_seed(cfg.train.seed * 1000 + index)
    return DiffusionBlock(cfg.model, cfg.noise.sigma_data, index)


def reads_earlier(cfg: RunConfig) -> bool:
    """Whether a block's training reads the blocks before it (chain states or the relay channel)."""
    return cfg.train.block_input == "chain" or cfg.model.channel == "relay"


class EarlierBlocks:
    """The frozen copies of blocks 0..index-1 that a block trainer reads, forward only.

    refresh_every = 0 (blocks trained in order): they must be trained already, and stay as found.
    refresh_every = R (all blocks at once, as a swarm trains them): a block not yet published in
    the folder starts as its genesis state, and every R steps the trainer reloads the ones whose
    trainers published a newer snapshot. Nobody waits for anybody. `folder` None: all start as
    genesis, and their owner replaces them (a swarm node, with states fetched from peers).
    `versions` records which version of each was read last (0 = genesis).
    """

    def __init__(self, folder: Path | None, index: int, cfg: RunConfig, device: torch.device) -> None:
        self.folder, self.cfg, self.device = folder, cfg, device
        self.blocks: list[DiffusionBlock] = []
        self.versions: dict[str, dict] = {}
        for b in range(index):
            if cfg.train.refresh_every or folder is None:
                self.blocks.append(genesis_block(cfg, b).to(device).requires_grad_(False).eval())
                self.versions[checkpoint.block_name(b)] = {"sha256": "genesis", "step": 0}
            else:
                entry = load_earlier(folder, b, index, cfg)
                self.blocks.append(block_from(entry, cfg, device, b).requires_grad_(False))
                self.versions[entry.name] = {"sha256": entry.sha256, "step": entry.state.get("step", 0)}
        if cfg.train.refresh_every and folder is not None:
            self.refresh()

    def refresh(self) -> int:
        """Reload the blocks that have a newer published snapshot; returns how many changed."""
        changed = 0
        for b, block in enumerate(self.blocks):
            name = checkpoint.block_name(b)
            try:
                entry = checkpoint.load(self.folder, name)
                checkpoint.require_same_model(entry, self.cfg, self.folder, "this run")
            except checkpoint.CheckpointError as exc:  # not published yet, or being replaced right now
                log.debug("keeping %s as it is: %s", name, exc)
                continue
            if entry.sha256 != self.versions[name]["sha256"]:
                load_state(block, entry)
                self.versions[name] = {"sha256": entry.sha256, "step": entry.state.get("step", 0)}
                changed += 1
        return changed

    def replace(self, b: int, params: torch.Tensor, version: dict) -> None:
        """Block b's parameters (flat, in state-dict order) from elsewhere, and the version they are."""
        with torch.no_grad():
            vector_to_parameters(params.to(self.device), self.blocks[b].parameters())
        self.versions[checkpoint.block_name(b)] = dict(version)


def load_earlier(folder: Path, b: int, index: int, cfg: RunConfig) -> checkpoint.Entry:
    """Block b, which block `index` reads, with an error that says what to train first."""
    if not (folder / f"{checkpoint.block_name(b)}.json").exists():
        reads = " and ".join(what for what, used in (("chain states", cfg.train.block_input == "chain"),
                                                      ("the relay channel", cfg.model.channel == "relay")) if used)
        raise checkpoint.CheckpointError(
            f"block {index} reads blocks 0-{index - 1} ({reads}), and {folder} has no block {b} yet: train it first "
            f"(`spheroid train --block {b} --out {folder}`), or train all blocks at once with --refresh-every R")
    entry = checkpoint.load(folder, checkpoint.block_name(b))
    checkpoint.require_same_model(entry, cfg, folder, "this run")
    return entry


def block_trainer(cfg: RunConfig, index: int, out: Path | None, device: torch.device
                  ) -> tuple[DiffusionBlock, LossFn, EarlierBlocks | None]:
    """What training block `index` needs: the block (genesis state), its loss, and the frozen
    earlier blocks it reads (None when its training reads none), loaded from `out` (None: their
    genesis states, for a swarm node to replace with fetched ones)."""
    if not 0 <= index < cfg.model.n_blocks:
        raise ValueError(f"--block {index} is outside 0..{cfg.model.n_blocks - 1}")
    earlier = EarlierBlocks(out, index, cfg, device) if reads_earlier(cfg) else None
    block = genesis_block(cfg, index).to(device)
    if cfg.train.init_from_previous and index and earlier:  # block b starts where block b-1 ended
        log.info("block %d: %d tensors from block %d", index, inherit(block, earlier.blocks[-1]), index - 1)
    codebook = make_codebook(cfg.model).to(device)
    frozen = earlier.blocks if earlier else []
    if cfg.train.block_input == "chain":
        loss_fn = chain_state_loss(block, cfg, index, codebook, frozen)
        log.info("block %d: %d parameters, trained on chain states of %d frozen earlier block(s)", index,
                 parameter_count(block), index)
    else:
        loss_fn = block_loss(block, cfg, index, codebook, frozen)
        lo, hi = training_band(cfg.noise, cfg.model.n_blocks, index)
        log.info("block %d: %d parameters, noise band [%.3f, %.3f] with overlap", index,
                 parameter_count(block), lo, hi)
    if index and cfg.model.channel == "relay":
        log.info("block %d: its clean stream starts from block %d's (relay channel)", index, index - 1)
    return block, loss_fn, earlier


def train_block(cfg: RunConfig, index: int, data: torch.Tensor, out: Path, device: torch.device,
                save_every: int = 0, **fit_options) -> FitResult:
    """Train block `index`: only this block is updated; it reads frozen copies of the blocks before
    it when its training needs them (`reads_earlier`)."""
    block, loss_fn, earlier = block_trainer(cfg, index, out, device)
    name = checkpoint.block_name(index)
    extra = {"block": index, "reads": earlier.versions if earlier else {}}
    every = cfg.train.refresh_every

    def publish_and_refresh(done: int, loss: float) -> None:
        """All blocks at once: show the later blocks this one's progress; read the earlier ones'."""
        if not every or done % every or done == cfg.train.steps:
            return
        checkpoint.save(out, name, block, cfg, {"step": done, "loss": loss, "partial": True, **extra})
        if earlier and earlier.refresh():
            log.info("block %d step %d: read newer earlier blocks %s", index, done,
                     ", ".join(f"{k}@{v['step']}" for k, v in earlier.versions.items()))

    return fit(block, loss_fn, cfg, data, name, out, extra, save_every, after_step=publish_and_refresh,
               frozen=earlier.blocks if earlier else (), **fit_options)


def genesis_reference(cfg: RunConfig) -> Reference:
    """The end-to-end reference as it starts: seeded, so every replica of it builds the same one."""
    torch.manual_seed(cfg.train.seed)
    model = Reference(cfg.model)
    log.info("reference: %d layers, %s layout, %d parameters", cfg.model.n_blocks * cfg.model.layers_per_block,
             cfg.model.reference_layout, parameter_count(model))
    return model


def part_trainer(cfg: RunConfig, part: int, device: torch.device
                 ) -> tuple[torch.nn.Module, LossFn, EarlierBlocks | None]:
    """What a swarm node trains: block `part` (`block_trainer`, its earlier blocks in their genesis
    states for the node to replace), or the whole end-to-end reference (part REFERENCE_PART, as
    data-parallel replicas do), which reads nothing."""
    if part == REFERENCE_PART:
        model = genesis_reference(cfg).to(device)
        return model, reference_loss(model), None
    return block_trainer(cfg, part, None, device)


def train_reference(cfg: RunConfig, data: torch.Tensor, out: Path, device: torch.device,
                    save_every: int = 0, **fit_options) -> FitResult:
    """Train the end-to-end reference (depth n_blocks * layers_per_block) with next-byte CE."""
    model = genesis_reference(cfg).to(device)
    return fit(model, reference_loss(model), cfg, data, checkpoint.REFERENCE, out, {}, save_every, **fit_options)


# --- evaluation ------------------------------------------------------------------------------------


def evaluate_chain(model: str | Path | Chain, windows: torch.Tensor, draws: int, seed: int, device: torch.device,
                   chunk: int | None = None, noise: NoiseConfig | None = None) -> tuple[ChainScore, float]:
    """CE of the chain from pure noise (one draw and `draws` averaged), and block 0 alone (`model`: a
    checkpoint folder, or the chain loaded from one).

    `noise` may change how the chain is run (steps per block, churn); by default the trained one.
    """
    cfg, blocks, codebook = model if isinstance(model, tuple) else load_chain(model, device)
    gen = torch.Generator(device).manual_seed(seed)
    chain = score(blocks, noise or cfg.noise, codebook, windows, draws, gen, chunk=chunk)
    alone = score_block_alone(blocks[0], cfg.noise, codebook, windows, gen)
    return chain, alone


def evaluate_bound(model: str | Path | Chain, windows: torch.Tensor, seed: int, device: torch.device) -> BoundScore:
    """The variational bound on the CE of the diffusion model the blocks in `model` (a checkpoint folder, or
    the chain loaded from one) define."""
    cfg, blocks, codebook = model if isinstance(model, tuple) else load_chain(model, device)
    return score_bound(blocks, cfg.noise, codebook, windows, torch.Generator(device).manual_seed(seed))


@torch.no_grad()
def evaluate_reference(reference: str | Path | Reference, windows: torch.Tensor, device: torch.device) -> float:
    """Next-byte CE (nats/byte) of the reference (in a checkpoint folder, or loaded from one) on the given windows."""
    model = reference if isinstance(reference, Reference) else load_reference(reference, device)[1]
    nll, count = 0.0, 0
    progress = Progress(log, "scoring the reference", windows.shape[0], "windows")
    for i in range(0, windows.shape[0], 64):
        w = windows[i : i + 64].to(device)
        logits = model(w[:, :-1]).float()
        nll += fn.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
        progress.update(i + w.shape[0])
    return nll / count
