"""The Euler chain down the block stack: scoring held-out text and generating bytes.

Every use of the composed model goes through `denoise`: start at pure noise, let the block that owns
each grid level take one Euler step of the probability-flow ODE, and read the final logits from the
last block at sigma_min. A CE from this chain is an honest likelihood of the composed model; a CE
from one block handed a noisy copy of the true target is not, and nothing here computes one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as fn

from .config import NoiseConfig
from .model import CleanStream, DiffusionBlock, Reference, Span
from .noise import band, sigma_grid
from .progress import Progress

log = logging.getLogger(__name__)

DEFAULT_DRAFT = 8  # speculative decoding: the most drafted bytes a traversal checks, unless told


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
    sigma_min = torch.full((x.shape[0],), noise.sigma_min, device=x.device)
    return blocks[last](x, z, sigma_min, start, chunk, streams[last], streams.get(last - 1)).float()


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
        sigma_min = torch.full((x.shape[0],), noise.sigma_min, device=x.device)
        logits = blocks[last](x, z, sigma_min, 0, None, streams[last], streams.get(last - 1)).float()
        recon += fn.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return BoundScore(prior / count, diffusion / count, recon / count)


def traversal_generators(seed: int, traversal: int, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    """(noise, sampling) generators of one byte of a generation (`traversal`: the byte's index after
    the prompt), or of one traversal of scoring, from the request's seed.

    Derived per byte, so a pipeline (noise drawn by its first node, bytes sampled by its last) and
    one machine produce the same bytes for the same seed, whichever traversal denoises the byte.
    """
    base = (seed * 1_000_003 + traversal) * 2 % (1 << 64)  # (torch takes seeds below 2^64; seeds go up to 2^63 - 1)
    return torch.Generator(device).manual_seed(base), torch.Generator(device).manual_seed(base + 1)


def starting_noise(seed: int, first: int, n: int, d: int, device: torch.device) -> torch.Tensor:
    """eps (1, n, d) for generated bytes first..first+n-1: row j from byte first + j's own generator."""
    return torch.cat([gaussian((1, 1, d), traversal_generators(seed, first + j, device)[0], device)
                      for j in range(n)], dim=1)


def sample_bytes(logits: torch.Tensor, temperature: float, seed: int, first: int) -> bytes:
    """Generated bytes first.. from their logits (n, V), each drawn with its own byte's generator."""
    return bytes(int(sample(logits[j : j + 1], temperature, traversal_generators(seed, first + j, logits.device)[1]))
                 for j in range(logits.shape[0]))


def window_start(n: int, k: int, context: int) -> int:
    """Where the clean window starts when the k bytes after the first n of a text are denoised.

    A window holds at most context - k + 1 clean bytes beside its k noisy ones. While the text fits
    it starts at 0; after that it moves in steps of half the context (as a KV-cached pipeline's
    must), so consecutive traversals share their window: a session's clean streams stay cached,
    and a speculative traversal that checks several bytes at once sees exactly the window each of
    them would have seen alone. A chunk too long for such a step slides the window byte by byte.
    """
    room = context - k + 1
    if n <= room:
        return 0
    step = context // 2
    start = -(-(n - room) // step) * step  # the first multiple of step that leaves at most `room` bytes
    return start if start < n else n - room


def next_window(out: bytes | bytearray, k: int, context: int) -> bytes:
    """The clean bytes a traversal reads to denoise the k after `out`."""
    return bytes(out[window_start(len(out), k, context) :])


def lookup_draft(text: bytes, limit: int, longest: int = 16, shortest: int = 3) -> bytes:
    """Up to `limit` bytes proposed to follow `text`: those that followed the latest earlier occurrence
    of its longest suffix of `shortest` to `longest` bytes (prompt-lookup drafting). It costs no model
    call, and greedy text, which repeats itself, is drafted well."""
    if limit <= 0:
        return b""
    for n in range(min(longest, len(text) - 1), shortest - 1, -1):
        at = text.rfind(text[-n:], 0, len(text) - 1)
        if at >= 0:
            return text[at + n : at + n + limit]
    return b""


@torch.no_grad()
def accept_draft(logits: torch.Tensor, draft: bytes, temperature: float, seed: int, first: int) -> bytes:
    """The bytes a speculative traversal yields, by the speculative-sampling rule for a draft that is
    one fixed byte per position (Leviathan et al. 2023; Chen et al. 2023).

    logits (len(draft) + 1, V): the K = 1 model's prediction of each drafted byte and of the byte
    after them, each given the bytes before it. Drafted byte j is kept with probability p_j(d_j);
    the first one refused is replaced by a draw from p_j with d_j taken out, and the rest dropped;
    if all are kept, a byte is drawn from the last row. Every byte is then distributed as chunk-1
    generation's; at temperature 0 (keep while d_j is the argmax) they are the same bytes.
    """
    out = bytearray()
    for j, byte in enumerate(draft):
        if temperature <= 0:
            if int(logits[j].argmax()) != byte:
                return bytes(out) + sample_bytes(logits[j : j + 1], temperature, seed, first + j)
        else:
            gen = traversal_generators(seed, first + j, logits.device)[1]
            probs = probabilities(logits[j], temperature).to(gen.device)
            if torch.rand((), generator=gen, device=gen.device).item() >= probs[byte].item():
                probs[byte] = 0.0
                return bytes(out) + bytes([int(torch.multinomial(probs, 1, generator=gen))])
        out.append(byte)
    return bytes(out) + sample_bytes(logits[-1:], temperature, seed, first + len(draft))


@dataclass(frozen=True)
class Traversal:
    """What one traversal of a generation denoises: the clean window `ctx`, `n_noisy` positions from
    `start` in chunks of `chunk`, and the drafted bytes at the end of ctx that it checks."""

    ctx: bytes
    start: int
    n_noisy: int
    chunk: int
    draft: bytes = b""


def next_traversal(out: bytes | bytearray, remaining: int, chunk: int, draft: int, context: int,
                   drafter: Callable[[bytes, int], bytes] = lookup_draft) -> Traversal:
    """The next traversal after `out` (prompt and bytes so far) with `remaining` bytes to go.

    draft = 0: denoise the next min(chunk, remaining) bytes together. draft > 0 (speculative, chunk
    1): append up to `draft` bytes from `drafter(text, limit)` to the window, and score each of them
    and the byte after them; only as many as stay in the window the first of them is denoised in.
    """
    if not draft:
        k = min(chunk, remaining)
        ctx = next_window(out, k, context)
        return Traversal(ctx, len(ctx) - 1, k, k)
    window = next_window(out, 1, context)
    guess = drafter(bytes(out), min(draft, remaining - 1, context - len(window)))
    return Traversal(window + guess, len(window) - 1, len(guess) + 1, 1, guess)


@torch.no_grad()
def generate(
    blocks: Sequence[DiffusionBlock],
    noise: NoiseConfig,
    codebook: torch.Tensor,
    prompt: bytes,
    n_bytes: int,
    chunk: int,
    temperature: float,
    seed: int,
    draft: int = 0,
    stats: dict | None = None,
    drafter: str = "lookup",
) -> bytes:
    """Generate n_bytes after prompt, `chunk` bytes per traversal of the chain.

    Each traversal denoises the next `chunk` bytes together (they attend to each other and to the
    clean context before them); temperature 0 takes the most likely byte. With `draft` > 0 (chunk
    1) each traversal checks up to `draft` drafted bytes (`next_traversal`, `accept_draft`): the
    distribution of chunk 1 in fewer traversals, and its very bytes at temperature 0. The drafts
    come from prompt lookup (`drafter` "lookup", free) or from a greedy sweep of the same blocks
    over the drafted positions ("sweep", a traversal of its own; blocks trained with a mix of
    chunk sizes draft well). A merged-layout model (K = 1) denoises every position of its context
    window in each traversal, exactly as scoring does, and reads the last one. `stats`, if given,
    receives the traversals (sweep drafts included) and the bytes drafted and kept.
    """
    context, merged = blocks[0].cfg.context, blocks[0].cfg.layout == "merged"
    if chunk < 1 or chunk > context - 1 or (merged and chunk != 1):
        raise ValueError(f"chunk must be in [1, {context - 1}] for a context of {context} bytes"
                         + (", and 1 for a merged-layout model" if merged else ""))
    if draft and (chunk != 1 or merged):
        raise ValueError("speculative decoding checks drafts under the K = 1 mask of a concat-layout model: chunk 1")
    if drafter not in ("lookup", "sweep"):
        raise ValueError(f"drafter must be lookup or sweep, got {drafter!r}")
    device, d = codebook.device, codebook.shape[1]
    out = bytearray(prompt or b"\n")  # the chain needs at least one clean byte to condition on
    begin, traversals, drafted, kept = len(out), 0, 0, 0

    def sweep_draft(text: bytes, limit: int) -> bytes:
        """The sweep's most likely bytes for the next `limit` positions (from the noise the check uses)."""
        nonlocal traversals
        if limit <= 0:
            return b""
        t = next_traversal(text, limit, limit, 0, context)
        x = torch.tensor(list(t.ctx), dtype=torch.long, device=device)[None, :]
        eps = starting_noise(seed, len(text) - begin, limit, d, device)
        traversals += 1
        return bytes(denoise(blocks, noise, codebook, x, limit, None, t.start, limit, eps)[0].argmax(-1).tolist())

    while len(out) - begin < n_bytes:
        produced = len(out) - begin
        if merged:
            x = torch.tensor(list(out[-context:]), dtype=torch.long, device=device)[None, :]
            noise_gen, _ = traversal_generators(seed, produced, device)
            logits = denoise(blocks, noise, codebook, x, x.shape[1], noise_gen)[0, -1:]
            out.extend(sample_bytes(logits, temperature, seed, produced))
        else:
            t = next_traversal(out, n_bytes - produced, chunk, draft, context,
                               sweep_draft if drafter == "sweep" else lookup_draft)
            x = torch.tensor(list(t.ctx), dtype=torch.long, device=device)[None, :]
            eps = starting_noise(seed, produced, t.n_noisy, d, device)
            logits = denoise(blocks, noise, codebook, x, t.n_noisy, None, t.start, t.chunk, eps)[0]
            new = (accept_draft(logits, t.draft, temperature, seed, produced) if t.draft
                   else sample_bytes(logits, temperature, seed, produced))
            if t.draft:  # all but the last byte out are drafted bytes kept
                drafted, kept = drafted + len(t.draft), kept + len(new) - 1
            out.extend(new)
        traversals += 1
    if stats is not None:
        stats.update(traversals=traversals, drafted=drafted, kept=kept)
    return bytes(out[begin:])


@torch.no_grad()
def generate_reference(model: Reference, prompt: bytes, n_bytes: int, temperature: float, seed: int) -> bytes:
    """n_bytes after prompt from the end-to-end reference, one byte per forward pass, over the same
    windows (`window_start`) and with the same per-byte generators (`sample_bytes`) as the chain's
    autoregressive mode: what a replica set of the reference (DiLoCo) gives a user locally."""
    context, device = model.pos_emb.shape[0], model.pos_emb.device
    out = bytearray(prompt or b"\n")
    begin = len(out)
    while len(out) - begin < n_bytes:
        x = torch.tensor(list(next_window(out, 1, context)), dtype=torch.long, device=device)[None, :]
        out.extend(sample_bytes(model(x)[0, -1:], temperature, seed, len(out) - begin))
    return bytes(out[begin:])


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """One byte per row of logits (n, V): argmax at temperature 0, else a draw from softmax(l / T)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, temperature).to(generator.device), 1,
                             generator=generator).squeeze(-1)


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) over the last dimension, in float32, for any T > 0: the logits are shifted
    by their maximum before the division, and T is at least float32's smallest normal number, so that
    a tiny T (1e-300, 0 in float32) makes the most likely bytes certain instead of giving NaN."""
    logits = logits.float()
    temperature = max(temperature, torch.finfo(torch.float32).tiny)
    return fn.softmax((logits - logits.amax(dim=-1, keepdim=True)) / temperature, dim=-1)
