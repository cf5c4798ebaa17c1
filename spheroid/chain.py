"""The Euler chain down the block stack, and scoring held-out text with it.

Every use of the composed model goes through `denoise`: start at pure noise, let the block that owns
each grid level take one Euler step of the probability-flow ODE (`euler_steps`, which serving
nodes run for their share of the blocks), and read the final logits from the last block at
sigma_min (`read_off`, on one machine or on a route's last node). A CE from this chain is an honest
likelihood of the composed model; a CE from one block handed a noisy copy of the true target is
not, and nothing here computes one. Generating bytes with it is decoding.py's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as fn

from .config import NoiseConfig
from .model import CleanStream, DiffusionBlock, Span
from .noise import band, sigma_grid
from .progress import Progress

log = logging.getLogger(__name__)

def gaussian(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """N(0, 1) noise drawn from `generator` (on its own device; the global RNG if None), placed on device."""
    where = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=where).to(device)


Streams = dict[int, CleanStream]  # block index -> its clean stream over the context


@torch.no_grad()
def encode_context(blocks: Sequence[DiffusionBlock], x: torch.Tensor, streams: Streams | None = None) -> Streams:
    """Each block's clean stream over x (B, L), in order: with the relay channel each one starts from
    the stream of the block before it. Done once per context; every Euler step then reads it."""
    streams = {} if streams is None else streams
    for b, block in enumerate(blocks):
        block.encode(x, streams.setdefault(b, CleanStream(len(block.net.layers))), streams.get(b - 1))
    return streams


@torch.no_grad()
def chain_state(
    blocks: Sequence[DiffusionBlock],
    noise: NoiseConfig,
    codebook: torch.Tensor,
    x: torch.Tensor,
    n_noisy: int,
    generator: torch.Generator | None,
    steps: int | None = None,
    start: int = 0,
    chunk: int | None = None,
    streams: Streams | None = None,
    eps: torch.Tensor | None = None,
) -> torch.Tensor:
    """z after the first `steps` grid steps (all of them by default) from z = sigma_max * eps.

    x: (B, L) clean context. Step i is taken by block i // steps_per_block, so with one step per
    block each block runs once. With churn > 0 (a stochastic sampler, as EDM's) each step first
    re-injects fresh noise up to sigma_hat = sigma * (1 + churn). Returns z (B, n_noisy, d).
    `streams` receives the clean streams of the blocks that ran (for the read-off, or a relay).
    `eps`: the starting noise (B, n_noisy, d); drawn from `generator` if None.
    """
    grid = sigma_grid(noise, len(blocks))
    steps = len(grid) - 1 if steps is None else steps
    if eps is None:
        eps = gaussian((x.shape[0], n_noisy, codebook.shape[1]), generator, codebook.device)
    z = grid[0].item() * eps
    streams = {} if streams is None else streams
    return euler_steps(dict(enumerate(blocks)), noise, grid, codebook, [Span(x, start, n_noisy, chunk)], z,
                       range(steps), generator, [streams])


@torch.no_grad()
def euler_steps(
    blocks: dict[int, DiffusionBlock],
    noise: NoiseConfig,
    grid: torch.Tensor,
    codebook: torch.Tensor,
    spans: list[Span],
    z: torch.Tensor,
    steps: range,
    generator: torch.Generator | None,
    streams: list[Streams],
) -> torch.Tensor:
    """Grid steps `steps` of the chain on z, each by the block that owns it (blocks: index -> block).

    A serving node holding some of the blocks runs its share of the steps with this, so a pipeline
    of nodes computes exactly what `chain_state` computes on one machine. `spans` are the sequences
    z holds: one (z: (B, N, d)), or several packed one after another (z: (1, sum of n, d)), as a
    serving node batches concurrent sessions. Each block's clean stream is computed at its first
    step and kept in the span's `streams` (per block; a serving session keeps them between calls,
    so only new bytes are computed); a block reading the relay channel reads the stream of the
    block before it there.
    """
    b, levels = z.shape[0], grid.tolist()
    for i in steps:
        sigma = levels[i]
        if noise.churn > 0 and i > 0:
            sigma_hat = min(sigma * (1 + noise.churn), noise.sigma_max)
            z = z + (sigma_hat**2 - sigma**2) ** 0.5 * gaussian(tuple(z.shape), generator, codebook.device)
            sigma = sigma_hat
        index = i // noise.steps_per_block
        own = [s.setdefault(index, CleanStream(len(blocks[index].net.layers))) for s in streams]
        logits = blocks[index].forward_packed(spans, z, torch.full((b,), sigma, device=z.device), own,
                                              [s.get(index - 1) for s in streams])
        d_hat = fn.softmax(logits.float(), dim=-1) @ codebook  # expected clean embedding
        z = z + (levels[i + 1] - sigma) * (z - d_hat) / sigma
    return z


@torch.no_grad()
def denoise(
    blocks: Sequence[DiffusionBlock],
    noise: NoiseConfig,
    codebook: torch.Tensor,
    x: torch.Tensor,
    n_noisy: int,
    generator: torch.Generator | None,
    start: int = 0,
    chunk: int | None = None,
    eps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the whole chain from pure noise (`eps`, or drawn from `generator`); the last block reads off
    the final logits (B, n_noisy, V)."""
    streams: Streams = {}
    z = chain_state(blocks, noise, codebook, x, n_noisy, generator, None, start, chunk, streams, eps)
    last = len(blocks) - 1
    return read_off(blocks[last], noise, [Span(x, start, n_noisy, chunk)], z, [streams[last]],
                    [streams.get(last - 1)])


def read_off(
    block: DiffusionBlock,
    noise: NoiseConfig,
    spans: list[Span],
    z: torch.Tensor,
    streams: list[CleanStream],
    previous: list[CleanStream | None],
) -> torch.Tensor:
    """The final logits (float32) the last block reads off z at sigma_min: the read-off of every chain,
    on one machine (`denoise`) or on a route's last node for the hops of a batch (z, spans and
    streams as for `euler_steps`; `previous`: the clean streams of the block before it, if it reads them)."""
    sigma_min = torch.full((z.shape[0],), noise.sigma_min, device=z.device)
    return block.forward_packed(spans, z, sigma_min, streams, previous).float()


@dataclass(frozen=True)
class ChainScore:
    """CE in nats/byte of one draw (averaged over draws) and of the draws' averaged probabilities."""

    ce_one_draw: float
    ce_averaged: float
    draws: int
    bytes_scored: int


@torch.no_grad()
def score(
    blocks: Sequence[DiffusionBlock],
    noise: NoiseConfig,
    codebook: torch.Tensor,
    windows: torch.Tensor,
    draws: int,
    generator: torch.Generator,
    chunk: int | None = None,
    batch: int = 64,
) -> ChainScore:
    """CE of windows (W, T+1) under the chain from pure noise with a clean context.

    The M draws of each window run as one batch. The model's predictive distribution is the mean of
    the M draws' final distributions (`ce_averaged`); `ce_one_draw` is the mean CE of single draws.
    """
    device = codebook.device
    nll_one, nll_avg, count = 0.0, 0.0, 0
    progress = Progress(log, f"scoring the chain ({draws} draws)", windows.shape[0], "windows")
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch].to(device)
        x, y = w[:, :-1], w[:, 1:]  # (b, T)
        xs = x.repeat_interleave(draws, dim=0)  # (b*M, T): draws of one window are adjacent
        logits = denoise(blocks, noise, codebook, xs, x.shape[1], generator, chunk=chunk)
        logp = fn.log_softmax(logits, dim=-1).view(x.shape[0], draws, x.shape[1], -1)  # (b, M, T, V)
        target = y[:, None, :, None].expand(-1, draws, -1, 1)
        logp_y = logp.gather(-1, target).squeeze(-1)  # (b, M, T)
        nll_one += -logp_y.mean(dim=1).sum().item()
        nll_avg += -(torch.logsumexp(logp_y, dim=1) - torch.log(torch.tensor(float(draws)))).sum().item()
        count += y.numel()
        progress.update(i + w.shape[0])
    return ChainScore(nll_one / count, nll_avg / count, draws, count)


@torch.no_grad()
def score_block_alone(
    block: DiffusionBlock, noise: NoiseConfig, codebook: torch.Tensor, windows: torch.Tensor,
    generator: torch.Generator, batch: int = 64,
) -> float:
    """CE of one block's prediction at sigma_max from pure noise: what the first block knows alone."""
    nll, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch].to(codebook.device)
        x, y = w[:, :-1], w[:, 1:]
        eps = gaussian((*x.shape, codebook.shape[1]), generator, x.device)
        sigma = torch.full((x.shape[0],), noise.sigma_max, device=x.device)
        logits = block(x, noise.sigma_max * eps, sigma).float()
        nll += fn.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return nll / count


@dataclass(frozen=True)
class BoundScore:
    """The terms of the variational bound, each in nats/byte; `total` is the bound on CE."""

    prior: float
    diffusion: float
    reconstruction: float

    @property
    def total(self) -> float:
        return self.prior + self.diffusion + self.reconstruction


@torch.no_grad()
def score_bound(
    blocks: Sequence[DiffusionBlock], noise: NoiseConfig, codebook: torch.Tensor, windows: torch.Tensor,
    generator: torch.Generator, points_per_band: int = 8, batch: int = 64,
) -> BoundScore:
    """The continuous-time variational bound (Kingma et al. 2021, VDM) on the CE of the diffusion model
    whose denoiser at each sigma is the owning block's expected embedding D = softmax(logits) @ e:

        KL(N(e(y), s_max^2 I) || N(0, s_max^2 I))                      prior
        + integral over [s_min, s_max] of ||e(y) - D(z_s, s)||^2 / s^3 ds    diffusion
        - log p(y | z at s_min), read by the last block                 reconstruction

    with z_s = e(y) + s * eps. Using the noisy true target is legitimate here: the bound charges for
    everything z reveals. It bounds the likelihood of the diffusion model the blocks define (sampled
    stochastically), not of the deterministic Euler chain. The integral is split over the blocks'
    bands, each by stratified quadrature in log sigma with one noise draw per point.
    """
    n_blocks = len(blocks)
    prior = diffusion = recon = 0.0
    count = 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch].to(codebook.device)
        x, y = w[:, :-1], w[:, 1:]
        e = codebook[y]  # (b, T, d)
        streams = encode_context(blocks, x)
        prior += (e.pow(2).sum(-1) / (2 * noise.sigma_max**2)).sum().item()
        for b, block in enumerate(blocks):
            lo, hi = band(noise, n_blocks, b)
            width = math.log(hi / lo) / points_per_band
            for k in range(points_per_band):
                u = torch.rand((), generator=generator, device=generator.device).item()
                sigma = math.exp(math.log(lo) + (k + u) * width)
                z = e + sigma * gaussian(e.shape, generator, e.device)
                logits = block(x, z, torch.full((x.shape[0],), sigma, device=x.device), 0, None, streams[b],
                               streams.get(b - 1))
                d_hat = fn.softmax(logits.float(), dim=-1) @ codebook
                # ds = sigma * d(log sigma), so the integrand times ds is ||e - D||^2 / sigma^2 * width
                diffusion += ((e - d_hat).pow(2).sum(-1) / sigma**2 * width).sum().item()
        z = e + noise.sigma_min * gaussian(e.shape, generator, e.device)
        last = n_blocks - 1
        logits = read_off(blocks[last], noise, [Span(x, 0, y.shape[1], None)], z, [streams[last]],
                          [streams.get(last - 1)])
        recon += fn.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return BoundScore(prior / count, diffusion / count, recon / count)
