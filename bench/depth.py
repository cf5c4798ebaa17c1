"""Depth screens: where the chain's gap to the end-to-end reference goes, what closes it, what it costs.

Every job trains and scores one configuration in a process of its own, `--jobs` at a time (at these
sizes a GPU step is bound by kernel launches, so one GPU runs many jobs side by side). Jobs:

  - screens, 2 blocks x 1 layer, `screen` steps per block (the depth preset's shapes), each against
    plain references of depth 1, 2 and 4 trained in the same run: today's default, an MLP relay head,
    block b starting from block b-1's weights, noisy tokens reading their block's own clean-stream
    output (relay loss 0 and 1), relay-loss weights, 2 x 2 layers against 4 x 1, fewer noisy
    positions per batch, and the in-order trainer that caches the frozen blocks' outputs;
  - at the depth preset (4 blocks x 1 layer, `full` steps), the gap split: today's chain; (a) the
    clean streams alone trained greedily through their relay heads, no denoiser, scored through
    the last relay head, then (b) that stack fine-tuned end to end; the same stack trained end to
    end from scratch, then (c) the chain whose denoisers read that stack's (frozen) clean streams,
    and (c0) one query stream on those streams with nothing to denoise; plus candidate changes.

CE is nats/byte on `eval_windows` windows of wiki.valid.tokens: chains from pure noise at M = 1 and
M = 8, their block 0 alone, references and stacks by next-byte CE. Training FLOPs are torch's
FlopCounterMode count of one step (as `spheroid.train.fit` counts it) times the steps, plus, for the
cached trainer, its cache-building passes. The JSON (--out) is rewritten after every job and every
30 s, so a run cut short keeps what it finished (and what running jobs had reached).

    python bench/depth.py [--preset depth|ci] [--device cuda] [--jobs 14] [--only NAME ...] [--out FILE]

bench/results/depth-screens.json is one run of all 26 jobs on one H200, 15 at a time (443 s):
    DEPTH_COMMIT=<sha> DEPTH_DIRTY=1 SPHEROID_DATA=<wikitext> python3 bench/depth.py --preset depth \
        --device cuda --jobs 15 --deadline 300 --deadline-kill 495 --log-every 500 --out depth-screens.json
On this 2-core CPU, `--preset ci --device cpu --jobs 2` runs every job's code in about 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as fn  # noqa: E402
from provenance import provenance  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from spheroid import checkpoint  # noqa: E402
from spheroid.chain import chain_state, encode_context, gaussian  # noqa: E402
from spheroid.config import ModelConfig, NoiseConfig, RunConfig, TrainConfig, override  # noqa: E402
from spheroid.data import fixed_windows, load_bytes, random_windows  # noqa: E402
from spheroid.model import CleanStream, DiffusionBlock, inherit, init_weights, make_codebook, relay_head  # noqa: E402
from spheroid.noise import sigma_grid  # noqa: E402
from spheroid.train import (  # noqa: E402
    FitResult,
    autocast,
    evaluate_chain,
    evaluate_reference,
    fit,
    genesis_block,
    noisy_span,
    pick_device,
    relay_ce,
    train_block,
    train_reference,
)

log = logging.getLogger("bench.depth")

PRESETS: dict[str, dict] = {
    # the depth preset's shapes (bench/quality.py); screens at 2 blocks, the gap split at 4
    "depth": {"model": {"d_model": 128, "n_heads": 4, "context": 128}, "batch": 32, "lr": 2e-3,
              "screen": {"n_blocks": 2, "steps": 1000, "warmup": 100},
              "full": {"n_blocks": 4, "steps": 2000, "warmup": 200},
              "finetune_steps": 500, "eval_windows": 256},
    # a smoke run for this machine's CPU: seconds, numbers meaningless
    "ci": {"model": {"d_model": 32, "n_heads": 2, "context": 32}, "batch": 4, "lr": 2e-3,
           "screen": {"n_blocks": 2, "steps": 4, "warmup": 2},
           "full": {"n_blocks": 3, "steps": 4, "warmup": 2},
           "finetune_steps": 2, "eval_windows": 8},
}
DRAWS = 8


def candidates(preset: str) -> dict[str, tuple[str, dict, dict]]:
    """The changes screened: name -> (what, model fields, train fields)."""
    quarter, half = PRESETS[preset]["model"]["context"] // 4, PRESETS[preset]["model"]["context"] // 2
    return {
        "default": ("today's default (relay loss 1, gates 1, linear relay head)", {}, {}),
        "mlp128": ("MLP relay head, hidden 128", {"relay_head_hidden": 128}, {}),
        "initprev": ("block b starts from block b-1's weights", {}, {"init_from_previous": True}),
        "stream-w1": ("noisy tokens read the own clean stream, relay loss 1", {"noisy_anchor": "stream"}, {}),
        "stream-w0": ("noisy tokens read the own clean stream, relay loss 0",
                      {"noisy_anchor": "stream", "relay_loss": 0.0}, {}),
        "w0.3": ("relay loss 0.3", {"relay_loss": 0.3}, {}),
        "w3": ("relay loss 3", {"relay_loss": 3.0}, {}),
        "mlp512": ("MLP relay head, hidden 512", {"relay_head_hidden": 512}, {}),
        "combo": ("MLP head 128 + own stream (W 1) + start from block b-1",
                  {"relay_head_hidden": 128, "noisy_anchor": "stream"}, {"init_from_previous": True}),
        "np-quarter": (f"{quarter} noisy positions per sequence", {}, {"noisy_positions": quarter}),
        "np-half": (f"{half} noisy positions per sequence", {}, {"noisy_positions": half}),
    }


@dataclass(frozen=True)
class Job:
    name: str
    kind: str  # refs | chain | cached | greedy | e2e
    scale: str  # screen | full
    what: str
    model: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    depths: tuple[int, ...] = ()


def jobs(preset: str) -> list[Job]:
    """Every job, the most wanted and the longest first."""
    c = candidates(preset)
    full_blocks = PRESETS[preset]["full"]["n_blocks"]

    def chain(name: str, scale: str) -> Job:
        return Job(f"{scale[0]}-{name}", "chain", scale, *c[name])

    return [
        Job("f-e2e", "e2e", "full", "stack trained end to end; chain and query stream on its frozen clean streams"),
        chain("default", "full"),
        Job("f-greedy", "greedy", "full", "clean streams alone, greedy through relay heads; then fine-tuned e2e"),
        Job("f-refs", "refs", "full", "plain references", depths=(1, full_blocks)),
        Job("s-refs", "refs", "screen", "plain references", depths=(1, 2, 4)),
        chain("stream-w1", "full"),
        chain("combo", "full"),
        chain("np-quarter", "full"),
        Job("f-cached-np-quarter", "cached", "full", f"cached earlier blocks + {c['np-quarter'][0]}",
            *c["np-quarter"][1:]),
        chain("initprev", "full"),
        *(chain(name, "screen") for name in ("default", "stream-w1", "stream-w0", "initprev", "mlp128", "combo",
                                             "w0.3", "w3", "np-quarter", "np-half")),
        Job("s-2x2", "chain", "screen", "2 blocks x 2 layers (against 4 layers)", {"layers_per_block": 2}),
        Job("s-4x1", "chain", "screen", "4 blocks x 1 layer (against 4 layers)", {"n_blocks": 4}),
        chain("mlp512", "screen"),
        Job("s-cached", "cached", "screen", "today's default, cached earlier blocks"),
        chain("mlp128", "full"),
        Job("f-cached", "cached", "full", "today's default, cached earlier blocks"),
    ]


def run_config(preset: str, scale: str, model: dict | None = None, train: dict | None = None,
               seed: int = 0) -> RunConfig:
    """A job's configuration; `seed` (the training seed: batches, noise, initialisation) repeats a
    screen on other draws, so that a difference can be told from seed noise."""
    p, s = PRESETS[preset], PRESETS[preset][scale]
    m = {**p["model"], "layers_per_block": 1, "n_blocks": s["n_blocks"], **(model or {})}
    t = {"batch": p["batch"], "lr": p["lr"], "steps": s["steps"], "warmup": s["warmup"], "seed": seed,
         **(train or {})}
    return RunConfig(model=ModelConfig(**m), noise=NoiseConfig(), train=TrainConfig(**t))


# --- the jobs (each in its own process) ------------------------------------------------------------


@dataclass
class Context:
    preset: str
    device: torch.device
    work: Path
    data: torch.Tensor
    valid: torch.Tensor
    emit: Callable[[dict], None]
    log_every: int
    seed: int = 0


def fit_record(r: FitResult, steps: int) -> dict:
    return {"train_flops": r.flops_per_step * steps, "params": r.params, "wall_s": r.wall_s,
            "final_ce": r.final_ce, "peak_gpu_mb": r.peak_gpu_mb}


def run_refs(job: Job, ctx: Context) -> dict:
    result: dict = {}
    for depth in job.depths:
        cfg = run_config(ctx.preset, job.scale, {"n_blocks": depth}, seed=ctx.seed)
        folder = ctx.work / f"reference-{depth}"
        r = train_reference(cfg, ctx.data, folder, ctx.device, log_every=ctx.log_every)
        result[str(depth)] = {"ce": evaluate_reference(folder, ctx.valid, ctx.device), "depth": depth,
                              **fit_record(r, cfg.train.steps)}
        ctx.emit(result)
    return result


def chain_record(cfg: RunConfig, fits: list[FitResult], chain, alone: float, extra_flops: int = 0) -> dict:
    steps = cfg.train.steps
    return {"ce": chain.ce_one_draw, "ce_m8": chain.ce_averaged, "block0_alone_ce": alone,
            "depth": cfg.model.n_blocks * cfg.model.layers_per_block, "n_blocks": cfg.model.n_blocks,
            "layers_per_block": cfg.model.layers_per_block, "steps": steps,
            "train_flops": sum(f.flops_per_step for f in fits) * steps + extra_flops,
            "train_flops_per_block": [f.flops_per_step * steps for f in fits],
            "params": sum(f.params for f in fits), "params_per_block": [f.params for f in fits],
            "wall_s": [f.wall_s for f in fits], "peak_gpu_mb": max(f.peak_gpu_mb for f in fits)}


def run_chain(job: Job, ctx: Context) -> dict:
    """The blocks trained in order by the library's own trainer (`spheroid train --block b`)."""
    cfg = run_config(ctx.preset, job.scale, job.model, job.train, ctx.seed)
    fits = []
    for b in range(cfg.model.n_blocks):
        fits.append(train_block(cfg, b, ctx.data, ctx.work, ctx.device, log_every=ctx.log_every))
        ctx.emit({"blocks_trained": b + 1})
    chain, alone = evaluate_chain(ctx.work, ctx.valid, DRAWS, 0, ctx.device)
    return chain_record(cfg, fits, chain, alone)


def euler(z: torch.Tensor, logits: torch.Tensor, codebook: torch.Tensor, sigma: float, following: float
          ) -> torch.Tensor:
    d_hat = fn.softmax(logits.float(), dim=-1) @ codebook
    return z + (following - sigma) * (z - d_hat) / sigma


def run_cached(job: Job, ctx: Context) -> dict:
    """Blocks trained in order as `spheroid train` trains them (chain states, relay channel), but in one
    process that keeps, for every training batch, what the frozen blocks hand the next one: the
    relayed clean stream and the chain state z at its level. Each block then runs none of the
    earlier blocks: one forward pass of the block just trained over the batches extends the cache.
    Every block sees the same batches in the same order (as `fit` draws them, from one seed), each
    with one starting noise (shared by the blocks instead of drawn afresh for each)."""
    cfg = run_config(ctx.preset, job.scale, job.model, job.train, ctx.seed)
    t, n, length, d = cfg.train, cfg.model.n_blocks, cfg.model.context, cfg.model.d_model
    device = ctx.device
    if cfg.noise.steps_per_block != 1 or cfg.train.block_input != "chain" or cfg.model.channel != "relay":
        raise ValueError("the cached trainer covers chain states, the relay channel and one step per block")
    gen = torch.Generator().manual_seed(t.seed)
    batches = torch.stack([random_windows(ctx.data, t.batch, length + 1, gen) for _ in range(t.steps)])
    batches = batches.to(torch.uint8).to(device)  # (S, B, T + 1)
    span_gen = torch.Generator().manual_seed(t.seed + 1)
    spans = [noisy_span(cfg, length, span_gen) for _ in range(t.steps)]
    width = spans[0][1]
    grid = sigma_grid(cfg.noise, n).tolist()
    codebook = make_codebook(cfg.model).to(device)
    store = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache: dict[str, torch.Tensor] = {}

    def inputs(s: int) -> tuple[torch.Tensor, torch.Tensor, CleanStream | None, torch.Tensor]:
        w = batches[s].long()
        previous = None
        if "relay" in cache:
            previous = CleanStream(0)
            previous.out = cache["relay"][s].float()
        if "z" in cache:
            z = cache["z"][s].float()
        else:  # block 0 starts from pure noise, the same noise whenever step s comes round
            eps = gaussian((t.batch, width, d), torch.Generator(device).manual_seed(7919 * t.seed + s), device)
            z = grid[0] * eps
        return w[:, :-1], w[:, 1:], previous, z

    def make_loss(block: DiffusionBlock, b: int):
        levels = [b] + ([n] if b == n - 1 else [])
        level_gen = torch.Generator().manual_seed(t.seed + 17)
        step = [0]

        def loss(_windows: torch.Tensor, _gen: torch.Generator) -> tuple[torch.Tensor, float]:
            s = step[0]
            step[0] += 1
            x, y, previous, z = inputs(s)
            start, m = spans[s]
            level = levels[int(torch.randint(len(levels), (1,), generator=level_gen))]
            with autocast(device):
                if level > b:  # the last block's read-off: its own step first, without gradient
                    with torch.no_grad():
                        logits = block(x, z, torch.full((t.batch,), grid[b], device=device), start, None,
                                       CleanStream(len(block.net.layers)), previous)
                        z = euler(z, logits, codebook, grid[b], grid[b + 1])
                own = CleanStream(len(block.net.layers))
                logits = block(x, z, torch.full((t.batch,), grid[level], device=device), start, None, own, previous)
                relay = relay_ce(block, own, y)
            ce = fn.cross_entropy(logits.float().transpose(1, 2), y[:, start : start + m])
            return ce + cfg.model.relay_loss * relay, ce.item()

        return loss

    @torch.no_grad()
    def extend_cache(block: DiffusionBlock, b: int) -> int:
        """What block b hands on, for every batch; returns the FLOPs of doing so."""
        relay = torch.empty((t.steps, t.batch, length, d), dtype=store, device=device)
        z_next = torch.empty((t.steps, t.batch, width, d), dtype=store, device=device)
        flops = 0
        for s in range(t.steps):
            with FlopCounterMode(display=False) if s == 0 else NoCount() as counter:
                x, _, previous, z = inputs(s)
                own = CleanStream(len(block.net.layers))
                with autocast(device):
                    logits = block(x, z, torch.full((t.batch,), grid[b], device=device), spans[s][0], None, own,
                                   previous)
                relay[s] = own.out
                z_next[s] = euler(z, logits, codebook, grid[b], grid[b + 1])
            if s == 0:
                flops = counter.get_total_flops() * t.steps
        cache.update(relay=relay, z=z_next)
        return flops

    fits, blocks, build_flops = [], [], 0
    for b in range(n):
        block = genesis_block(cfg, b).to(device)
        if cfg.train.init_from_previous and blocks:
            inherit(block, blocks[-1])
        fits.append(fit(block, make_loss(block, b), cfg, ctx.data, checkpoint.block_name(b), ctx.work,
                        {"block": b, "reads": {}}, log_every=ctx.log_every))
        blocks.append(block.requires_grad_(False).eval())
        if b < n - 1:
            build_flops += extend_cache(block, b)
        ctx.emit({"blocks_trained": b + 1})
    cache.clear()
    chain, alone = evaluate_chain((cfg, blocks, codebook), ctx.valid, DRAWS, 0, device)
    return {**chain_record(cfg, fits, chain, alone, build_flops), "cache_flops": build_flops}


class NoCount:
    def __enter__(self) -> NoCount:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


# clean-stream stacks: the blocks' clean streams alone, read through relay heads (the gap split)

CLEAN = ("net.tok_emb", "net.pos_emb", "net.clean_cond", "net.layers")


def clean_stack(cfg: RunConfig, device: torch.device) -> list[DiffusionBlock]:
    """The blocks in their genesis states, each with a relay head (the last one's added here)."""
    stack = []
    for b in range(cfg.model.n_blocks):
        block = genesis_block(cfg, b)
        if block.relay_head is None:
            block.relay_head = relay_head(cfg.model)
            init_weights(block.relay_head)
        stack.append(block.to(device))
    return stack


def clean_params(stack: list[DiffusionBlock], heads: list[int]) -> int:
    """Parameters of the clean streams and of the relay heads numbered in `heads`."""
    return sum(p.numel() for b, block in enumerate(stack) for name, p in block.named_parameters()
               if name.startswith(CLEAN) or (b in heads and name.startswith("relay_head")))


def stack_logits(stack: list[DiffusionBlock], x: torch.Tensor) -> torch.Tensor:
    """Next-byte logits of the stack's last relay head (with gradient into every block that wants one)."""
    previous = None
    for block in stack:
        stream = CleanStream(len(block.net.layers))
        block.encode(x, stream, previous)
        previous = stream
    return stack[-1].relay_head(previous.out)


@torch.no_grad()
def score_stack(stack: list[DiffusionBlock], windows: torch.Tensor, device: torch.device) -> float:
    nll, count = 0.0, 0
    for i in range(0, windows.shape[0], 64):
        w = windows[i : i + 64].to(device)
        logits = stack_logits(stack, w[:, :-1]).float()
        nll += fn.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    return nll / count


def stack_loss(stack: list[DiffusionBlock]):
    def loss(windows: torch.Tensor, _gen: torch.Generator) -> tuple[torch.Tensor, float]:
        with autocast(windows.device):
            logits = stack_logits(stack, windows[:, :-1])
        ce = fn.cross_entropy(logits.float().transpose(1, 2), windows[:, 1:])
        return ce, ce.item()

    return loss


def greedy_loss(stack: list[DiffusionBlock], b: int):
    """Block b's clean stream trained alone through its relay head, the blocks before it frozen."""

    def loss(windows: torch.Tensor, _gen: torch.Generator) -> tuple[torch.Tensor, float]:
        x, y = windows[:, :-1], windows[:, 1:]
        with autocast(x.device):
            streams = encode_context(stack[:b], x)
            own = CleanStream(len(stack[b].net.layers))
            stack[b].encode(x, own, streams.get(b - 1))
            logits = stack[b].relay_head(own.out)
        ce = fn.cross_entropy(logits.float().transpose(1, 2), y)
        return ce, ce.item()

    return loss


def run_greedy(job: Job, ctx: Context) -> dict:
    """(a) greedy plain, then (b) the same stack fine-tuned end to end."""
    cfg = run_config(ctx.preset, job.scale, job.model, job.train, ctx.seed)
    stack = clean_stack(cfg, ctx.device)
    fits = []
    for b, block in enumerate(stack):
        fits.append(fit(block, greedy_loss(stack, b), cfg, ctx.data, f"greedy-{b}", ctx.work, log_every=ctx.log_every,
                        frozen=stack[:b]))
        block.requires_grad_(False)
    steps = cfg.train.steps
    result = {"greedy": {"ce": score_stack(stack, ctx.valid, ctx.device), "depth": cfg.model.n_blocks,
                         "train_flops": sum(f.flops_per_step for f in fits) * steps,
                         "params": clean_params(stack, list(range(len(stack)))), "steps": steps}}
    ctx.emit(result)
    ft_steps = PRESETS[ctx.preset]["finetune_steps"]
    ft = RunConfig(model=cfg.model, noise=cfg.noise,
                   train=override(cfg.train, steps=ft_steps, warmup=max(1, ft_steps // 10), lr=cfg.train.lr / 2))
    model = torch.nn.ModuleList(stack).requires_grad_(True)
    r = fit(model, stack_loss(stack), ft, ctx.data, "finetuned", ctx.work, log_every=ctx.log_every)
    result["finetuned"] = {"ce": score_stack(stack, ctx.valid, ctx.device), "steps": ft_steps, "lr": ft.train.lr,
                           "finetune_flops": r.flops_per_step * ft_steps}
    return result


def streams_of(stack: list[DiffusionBlock], x: torch.Tensor) -> dict[int, CleanStream]:
    return encode_context(stack, x)


def chain_on_streams_loss(block: DiffusionBlock, b: int, blocks: list[DiffusionBlock], stack: list[DiffusionBlock],
                          cfg: RunConfig, codebook: torch.Tensor):
    """Block b's chain-state loss, every clean stream (its own too) the frozen stack's."""
    n = cfg.model.n_blocks
    levels = [b] + ([n] if b == n - 1 else [])
    grid = sigma_grid(cfg.noise, n).tolist()

    def loss(windows: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, float]:
        x, y = windows[:, :-1], windows[:, 1:]
        level = levels[int(torch.randint(len(levels), (1,), generator=gen))]
        with autocast(x.device):
            streams = streams_of(stack, x)
            z = chain_state([*blocks, block], cfg.noise, codebook, x, x.shape[1], None, steps=level, streams=streams)
            sigma = torch.full((x.shape[0],), grid[level], device=x.device)
            logits = block(x, z.float(), sigma, 0, None, streams[b], streams.get(b - 1))
        ce = fn.cross_entropy(logits.float().transpose(1, 2), y)
        return ce, ce.item()

    return loss


def query_loss(block: DiffusionBlock, stack: list[DiffusionBlock], cfg: RunConfig):
    """The last block's query stream on the stack's frozen streams at sigma_max: nothing to denoise."""
    n = cfg.model.n_blocks

    def loss(windows: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, float]:
        x, y = windows[:, :-1], windows[:, 1:]
        with autocast(x.device):
            logits = query_logits(block, stack, cfg, x, n)
        ce = fn.cross_entropy(logits.float().transpose(1, 2), y)
        return ce, ce.item()

    return loss


def query_logits(block: DiffusionBlock, stack: list[DiffusionBlock], cfg: RunConfig, x: torch.Tensor,
                 n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    streams = streams_of(stack, x)
    sigma = cfg.noise.sigma_max
    z = sigma * gaussian((*x.shape, cfg.model.d_model), generator, x.device)
    return block(x, z, torch.full((x.shape[0],), sigma, device=x.device), 0, None, streams[n - 1], streams.get(n - 2))


@torch.no_grad()
def score_on_streams(blocks: list[DiffusionBlock], stack: list[DiffusionBlock], cfg: RunConfig,
                     codebook: torch.Tensor, windows: torch.Tensor, device: torch.device) -> dict:
    """`spheroid.chain.score` for a chain whose clean streams are the stack's."""
    gen = torch.Generator(device).manual_seed(0)
    last = len(blocks) - 1
    nll_one = nll_avg = 0.0
    count = 0
    for i in range(0, windows.shape[0], 64):
        w = windows[i : i + 64].to(device)
        x, y = w[:, :-1], w[:, 1:]
        xs = x.repeat_interleave(DRAWS, dim=0)
        streams = streams_of(stack, xs)
        z = chain_state(blocks, cfg.noise, codebook, xs, x.shape[1], gen, streams=streams)
        sigma_min = torch.full((xs.shape[0],), cfg.noise.sigma_min, device=device)
        logits = blocks[last](xs, z, sigma_min, 0, None, streams[last], streams.get(last - 1)).float()
        logp = fn.log_softmax(logits, dim=-1).view(x.shape[0], DRAWS, x.shape[1], -1)
        logp_y = logp.gather(-1, y[:, None, :, None].expand(-1, DRAWS, -1, 1)).squeeze(-1)
        nll_one += -logp_y.mean(dim=1).sum().item()
        nll_avg += -(torch.logsumexp(logp_y, dim=1) - torch.log(torch.tensor(float(DRAWS)))).sum().item()
        count += y.numel()
    return {"ce": nll_one / count, "ce_m8": nll_avg / count}


def run_e2e(job: Job, ctx: Context) -> dict:
    """The stack trained end to end from scratch; then (c) the chain, and (c0) one query stream, on
    its frozen clean streams (each block starting from the stack's block of the same index)."""
    cfg = run_config(ctx.preset, job.scale, job.model, job.train, ctx.seed)
    n, steps = cfg.model.n_blocks, cfg.train.steps
    stack = clean_stack(cfg, ctx.device)
    r = fit(torch.nn.ModuleList(stack), stack_loss(stack), cfg, ctx.data, "e2e-stack", ctx.work,
            log_every=ctx.log_every)
    for block in stack:
        block.requires_grad_(False).eval()
    result = {"e2e_stack": {"ce": score_stack(stack, ctx.valid, ctx.device), "train_flops": r.flops_per_step * steps,
                            "params": clean_params(stack, [n - 1]), "depth": n, "steps": steps}}
    ctx.emit(result)
    codebook = make_codebook(cfg.model).to(ctx.device)

    def started(b: int) -> DiffusionBlock:
        block = genesis_block(cfg, b).to(ctx.device)
        inherit(block, stack[b])
        return block

    query = started(n - 1)
    q = fit(query, query_loss(query, stack, cfg), cfg, ctx.data, "query", ctx.work, log_every=ctx.log_every,
            frozen=stack)
    query.eval()
    with torch.no_grad():
        gen = torch.Generator(ctx.device).manual_seed(0)
        nll, count = 0.0, 0
        for i in range(0, ctx.valid.shape[0], 64):
            w = ctx.valid[i : i + 64].to(ctx.device)
            logits = query_logits(query, stack, cfg, w[:, :-1], n, gen).float()
            nll += fn.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
            count += w[:, 1:].numel()
    result["query_on_e2e_streams"] = {"ce": nll / count, "train_flops": q.flops_per_step * steps}
    ctx.emit(result)
    blocks, fits = [], []
    for b in range(n):
        block = started(b)
        fits.append(fit(block, chain_on_streams_loss(block, b, blocks, stack, cfg, codebook), cfg, ctx.data,
                        f"c-block-{b}", ctx.work, log_every=ctx.log_every, frozen=[*stack, *blocks]))
        blocks.append(block.requires_grad_(False).eval())
        ctx.emit({**result, "chain_blocks_trained": b + 1})
    result["chain_on_e2e_streams"] = {**score_on_streams(blocks, stack, cfg, codebook, ctx.valid, ctx.device),
                                      "train_flops": sum(f.flops_per_step for f in fits) * steps}
    return result


RUNNERS = {"refs": run_refs, "chain": run_chain, "cached": run_cached, "greedy": run_greedy, "e2e": run_e2e}


def run_job(name: str, preset: str, device: torch.device, work: Path, data_dir: str | None, result_path: Path,
            log_every: int, seed: int = 0) -> None:
    job = {j.name: j for j in jobs(preset)}[name]
    started = time.monotonic()

    def emit(partial: dict, status: str = "running") -> None:
        tmp = result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"status": status, "wall_s": time.monotonic() - started, "result": partial}))
        tmp.replace(result_path)

    p = PRESETS[preset]
    valid = fixed_windows(load_bytes(data_dir, "valid"), p["eval_windows"], p["model"]["context"] + 1)
    ctx = Context(preset, device, work, load_bytes(data_dir, "train"), valid, emit, log_every, seed)
    emit({})
    emit(RUNNERS[job.kind](job, ctx), "done")


# --- the driver ------------------------------------------------------------------------------------


def summarise(preset: str, results: dict) -> list[dict]:
    """Rows of the table: each configuration against the plain reference of its depth (same steps)."""
    table = []
    refs = {scale: results.get(f"{'s' if scale == 'screen' else 'f'}-refs", {}).get("result", {})
            for scale in ("screen", "full")}

    def against(row: dict, scale: str, depth: int, one_deep: int = 1) -> dict:
        ref, single = refs[scale].get(str(depth)), refs[scale].get(str(one_deep))
        if ref:
            row["reference_ce"] = ref["ce"]
            if "train_flops" in row:
                row["flops_ratio"] = row["train_flops"] / ref["train_flops"]
            if "params" in row:
                row["params_ratio"] = row["params"] / ref["params"]
            if "ce" in row:
                row["gap"] = row["ce"] - ref["ce"]
        if single:
            row["one_block_reference_ce"] = single["ce"]
        return row

    for job in jobs(preset):
        entry = results.get(job.name)
        if not entry or not entry.get("result"):
            continue
        r, scale = entry["result"], job.scale
        base = {"job": job.name, "what": job.what, "scale": scale, "status": entry["status"]}
        if job.kind in ("chain", "cached") and "ce" in r:
            table.append(against({**base, **{k: r[k] for k in ("ce", "ce_m8", "block0_alone_ce", "depth",
                                                               "n_blocks", "layers_per_block", "train_flops",
                                                               "params")}},
                                 scale, r["depth"], r["layers_per_block"]))
        elif job.kind == "refs":
            for depth, ref in r.items():
                table.append({**base, "what": f"plain reference, {depth} layer(s)", "ce": ref["ce"],
                              "depth": ref["depth"], "train_flops": ref["train_flops"], "params": ref["params"]})
        elif job.kind == "greedy":
            if "greedy" in r:
                table.append(against({**base, "what": "(a) greedy clean stack, last relay head", **r["greedy"]},
                                     scale, r["greedy"]["depth"]))
            if "finetuned" in r:
                table.append(against({**base, "what": f"(b) (a) fine-tuned e2e {r['finetuned']['steps']} steps",
                                      "ce": r["finetuned"]["ce"], "depth": r["greedy"]["depth"]},
                                     scale, r["greedy"]["depth"]))
        elif job.kind == "e2e":
            depth = r.get("e2e_stack", {}).get("depth", 0)
            for key, label in (("e2e_stack", "the clean stack trained e2e from scratch"),
                               ("query_on_e2e_streams", "(c0) one query stream on its frozen streams, sigma_max"),
                               ("chain_on_e2e_streams", "(c) the chain on its frozen streams")):
                if key in r:
                    table.append(against({**base, "what": label, **r[key], "depth": depth}, scale, depth))
    return table


def print_table(table: list[dict]) -> None:
    print(f"\n{'job':<20} {'what':<58} {'CE M=1':>7} {'M=8':>7} {'blk0':>7} {'ref':>7} {'gap':>7} "
          f"{'FLOPs x':>7} {'params x':>8}")

    def f(row: dict, key: str, fmt: str = ".4f") -> str:
        return format(row[key], fmt) if key in row else "-"

    for row in table:
        print(f"{row['job']:<20} {row['what'][:58]:<58} {f(row, 'ce'):>7} {f(row, 'ce_m8'):>7} "
              f"{f(row, 'block0_alone_ce'):>7} {f(row, 'reference_ce'):>7} {f(row, 'gap', '+.4f'):>7} "
              f"{f(row, 'flops_ratio', '.2f'):>7} {f(row, 'params_ratio', '.2f'):>8}")


def portable_command(command: str) -> str:
    """The command line with absolute paths reduced to their last part (no machine's paths in results)."""
    return " ".join(Path(part).name if part.startswith("/") else part for part in command.split())


def drive(args: argparse.Namespace) -> dict:
    selected = [j for j in jobs(args.preset) if not args.only or j.name in args.only]
    if args.only and len(selected) != len(set(args.only)):
        known = ", ".join(j.name for j in jobs(args.preset))
        raise SystemExit(f"--only: unknown job(s) among {args.only}; known: {known}")
    work = Path(args.work)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = pick_device(args.device)
    info = provenance()
    info["command"] = portable_command(info["command"])
    if os.environ.get("DEPTH_COMMIT"):  # a copy of the tree (the device machine's) whose own git may be stale
        info.update(device_reported_commit=info["commit"], commit=os.environ["DEPTH_COMMIT"],
                    dirty=os.environ.get("DEPTH_DIRTY") == "1")
    record: dict = {"preset": args.preset, "settings": PRESETS[args.preset], "seed": args.seed, "draws_m8": DRAWS,
                    "device": str(device), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "jobs_at_once": args.jobs, "provenance": info}
    queue, running, results = list(selected), {}, {}
    started = time.monotonic()
    last_write = 0.0

    def collect(name: str) -> dict | None:
        path = work / f"{name}.result.json"
        return json.loads(path.read_text()) if path.exists() else None

    def write() -> None:
        for name in running:
            if (got := collect(name)) is not None:
                results[name] = got
        record.update(jobs={j.name: {"kind": j.kind, "scale": j.scale, "what": j.what, "model": j.model,
                                     "train": j.train, **results.get(j.name, {"status": "queued"})}
                            for j in selected},
                      table=summarise(args.preset, results), elapsed_s=time.monotonic() - started)
        out.write_text(json.dumps(record, indent=2))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        while queue or running:
            late = args.deadline and time.monotonic() - started > args.deadline
            while queue and len(running) < args.jobs and not late:
                job = queue.pop(0)
                folder = work / job.name
                folder.mkdir(parents=True, exist_ok=True)
                cmd = [sys.executable, __file__, "--job", job.name, "--preset", args.preset, "--device", str(device),
                       "--work", str(folder), "--result", str(work / f"{job.name}.result.json"),
                       "--log-every", str(args.log_every), "--seed", str(args.seed)]
                if args.data:
                    cmd += ["--data", args.data]
                logf = open(work / "logs" / f"{job.name}.log", "w")  # noqa: SIM115 (closed when it ends)
                running[job.name] = (subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env), logf)
                print(f"[{time.monotonic() - started:6.0f}s] started {job.name}", flush=True)
            if late and queue:
                print(f"[{time.monotonic() - started:6.0f}s] deadline: not starting {[j.name for j in queue]}",
                      flush=True)
                for job in queue:
                    results[job.name] = {"status": "not started (deadline)"}
                queue.clear()
            if late and args.deadline_kill and time.monotonic() - started > args.deadline_kill:
                for name, (proc, _) in running.items():
                    proc.kill()
                    print(f"[{time.monotonic() - started:6.0f}s] killed {name} at the deadline", flush=True)
            time.sleep(1.0)
            for name, (proc, logf) in list(running.items()):
                if proc.poll() is None:
                    continue
                logf.close()
                del running[name]
                got = collect(name) or {"result": {}}
                if proc.returncode != 0:
                    tail = (work / "logs" / f"{name}.log").read_text(errors="replace")[-1500:]
                    got["status"] = "failed" if proc.returncode > 0 else "killed"
                    got["error"] = tail
                    print(f"[{time.monotonic() - started:6.0f}s] {name} {got['status']}:\n{tail}", flush=True)
                else:
                    r = got.get("result", {})
                    brief = {k: round(v, 4) for k, v in r.items() if isinstance(v, float)}
                    print(f"[{time.monotonic() - started:6.0f}s] finished {name} ({got.get('wall_s', 0):.0f}s) "
                          f"{brief or ''}", flush=True)
                results[name] = got
            if time.monotonic() - last_write > 30 or not running:
                write()
                last_write = time.monotonic()
    finally:
        for proc, logf in running.values():
            if proc.poll() is None:
                proc.kill()
            logf.close()
        write()
    if args.logs_out:
        with open(args.logs_out, "w") as f:
            for job in selected:
                path = work / "logs" / f"{job.name}.log"
                if path.exists():
                    lines = path.read_text(errors="replace").splitlines()
                    f.write(f"==== {job.name}\n" + "\n".join(lines[-25:]) + "\n")
    print_table(record["table"])
    print(f"\nJSON: {out}")
    return record


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="depth", choices=sorted(PRESETS))
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    ap.add_argument("--data", default=None, help="WikiText folder (default: $SPHEROID_DATA)")
    ap.add_argument("--jobs", type=int, default=1, help="jobs at a time")
    ap.add_argument("--only", nargs="*", default=None, help="run these jobs only")
    ap.add_argument("--out", default=None, help="JSON (default runs/depth-screens-<preset>.json)")
    ap.add_argument("--work", default=None, help="checkpoints and logs (default runs/depth-<preset>)")
    ap.add_argument("--deadline", type=float, default=0, help="start no job after this many seconds")
    ap.add_argument("--deadline-kill", type=float, default=0, help="kill running jobs after this many seconds")
    ap.add_argument("--logs-out", default=None, help="also write the tail of every job's log here")
    ap.add_argument("--log-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0, help="training seed of every job (repeat a screen on other draws)")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    if args.job:
        run_job(args.job, args.preset, pick_device(args.device), Path(args.work), args.data, Path(args.result),
                args.log_every, args.seed)
        return None
    args.out = args.out or str(ROOT / "runs" / f"depth-screens-{args.preset}.json")
    args.work = args.work or str(ROOT / "runs" / f"depth-{args.preset}")
    return drive(args)


if __name__ == "__main__":
    main()
