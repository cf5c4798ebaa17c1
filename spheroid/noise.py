"""Noise levels: the restricted lognormal, its partition into blocks, sampling, and the Euler grid.

log sigma ~ Normal(p_mean, p_std) restricted to [sigma_min, sigma_max]. Working in the CDF of that
distribution makes every piece one line: the partition gives each block an equal share of the CDF,
training samples uniformly in the CDF range of a block's band, and the inference grid is evenly
spaced in the CDF.
"""

from __future__ import annotations

import torch

from .config import NoiseConfig


def cdf(noise: NoiseConfig, sigma: torch.Tensor | float) -> torch.Tensor:
    """Phi((ln sigma - p_mean) / p_std): the unrestricted lognormal CDF at sigma."""
    s = torch.as_tensor(sigma, dtype=torch.float64)
    return torch.special.ndtr((torch.log(s) - noise.p_mean) / noise.p_std)


def inverse_cdf(noise: NoiseConfig, q: torch.Tensor) -> torch.Tensor:
    """The sigma at which the lognormal CDF equals q."""
    return torch.exp(noise.p_mean + noise.p_std * torch.special.ndtri(q.to(torch.float64)))


def boundaries(noise: NoiseConfig, n_blocks: int) -> list[float]:
    """The n_blocks + 1 band edges, from sigma_min up to sigma_max, each band 1/n_blocks of the mass."""
    q_lo, q_hi = cdf(noise, noise.sigma_min), cdf(noise, noise.sigma_max)
    q = q_lo + torch.arange(n_blocks + 1, dtype=torch.float64) / n_blocks * (q_hi - q_lo)
    edges = inverse_cdf(noise, q).tolist()
    edges[0], edges[-1] = noise.sigma_min, noise.sigma_max  # exact ends, free of rounding
    return edges


def band(noise: NoiseConfig, n_blocks: int, block: int) -> tuple[float, float]:
    """The noise band of one block. Block 0 owns the highest band, block n_blocks-1 the lowest."""
    if not 0 <= block < n_blocks:
        raise ValueError(f"block {block} is outside 0..{n_blocks - 1}")
    edges = boundaries(noise, n_blocks)
    return edges[n_blocks - 1 - block], edges[n_blocks - block]


def training_band(noise: NoiseConfig, n_blocks: int, block: int) -> tuple[float, float]:
    """The band a block trains on: its own, widened by the overlap in log space, clipped to the range."""
    lo, hi = band(noise, n_blocks, block)
    a = (hi / lo) ** noise.overlap
    return max(lo / a, noise.sigma_min), min(hi * a, noise.sigma_max)


def sample_sigma(
    noise: NoiseConfig, lo: float, hi: float, n: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """n noise levels from the restricted lognormal, conditioned on [lo, hi]; float32 (n,)."""
    q_lo, q_hi = cdf(noise, lo), cdf(noise, hi)
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    return inverse_cdf(noise, q_lo + u * (q_hi - q_lo)).clamp(lo, hi).float()


def loss_weight(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """EDM's lambda(sigma) = (sigma^2 + sd^2) / (sigma * sd)^2, which evens out the loss over sigma."""
    return (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2


def sigma_grid(noise: NoiseConfig, n_blocks: int) -> torch.Tensor:
    """The inference grid: N + 1 levels from sigma_max down to sigma_min, evenly spaced in the CDF.

    N = n_blocks * steps_per_block, so step i is taken by block i // steps_per_block and the grid
    points between blocks are exactly the band edges.
    """
    n = n_blocks * noise.steps_per_block
    q_lo, q_hi = cdf(noise, noise.sigma_min), cdf(noise, noise.sigma_max)
    q = q_hi - torch.arange(n + 1, dtype=torch.float64) / n * (q_hi - q_lo)
    grid = inverse_cdf(noise, q)
    grid[0], grid[-1] = noise.sigma_max, noise.sigma_min
    return grid.float()

