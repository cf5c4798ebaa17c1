import pytest
import torch

from spheroid.config import NoiseConfig
from spheroid.model import DiffusionBlock
from spheroid.noise import band, boundaries, loss_weight, sample_sigma, sigma_grid, training_band


def test_partition_matches_method_md():
    edges = boundaries(NoiseConfig(sigma_min=1, sigma_max=10, p_mean=-1.2, p_std=1.2), 4)
    assert edges == pytest.approx([1.0, 1.238, 1.623, 2.429, 10.0], abs=5e-4)


def test_block_zero_owns_the_highest_band():
    noise = NoiseConfig()
    assert band(noise, 4, 0) == pytest.approx((2.429, 10.0), abs=5e-4)
    assert band(noise, 4, 3) == pytest.approx((1.0, 1.238), abs=5e-4)


def test_training_band_is_widened_by_the_overlap_and_clipped():
    noise = NoiseConfig()
    lo, hi = band(noise, 4, 1)
    a = (hi / lo) ** 0.1
    assert training_band(noise, 4, 1) == pytest.approx((lo / a, hi * a))
    assert training_band(noise, 4, 0)[1] == 10.0  # clipped at sigma_max
    assert training_band(noise, 4, 3)[0] == 1.0  # clipped at sigma_min


def test_sampled_sigma_stays_in_band_and_follows_the_lognormal():
    noise = NoiseConfig()
    lo, hi = training_band(noise, 4, 2)
    s = sample_sigma(noise, lo, hi, 20000, torch.Generator().manual_seed(0))
    assert s.min() >= lo and s.max() <= hi
    # over the whole range each block's band holds a quarter of the samples
    full = sample_sigma(noise, 1.0, 10.0, 20000, torch.Generator().manual_seed(1))
    edges = boundaries(noise, 4)
    counts = [((full >= edges[i]) & (full < edges[i + 1])).float().mean().item() for i in range(4)]
    assert counts == pytest.approx([0.25] * 4, abs=0.02)


def test_grid_runs_from_sigma_max_to_sigma_min_through_the_band_edges():
    noise = NoiseConfig()
    grid = sigma_grid(noise, 4)
    assert grid.tolist() == pytest.approx(list(reversed(boundaries(noise, 4))), rel=1e-5)
    two = sigma_grid(NoiseConfig(steps_per_block=2), 4)
    assert len(two) == 9 and two[::2].tolist() == pytest.approx(grid.tolist(), rel=1e-5)


@pytest.mark.parametrize(
    "sigma, c_skip, c_out, c_in, c_noise",
    [
        (1.0, 0.25 / 1.25, 0.5 / 1.25**0.5, 1 / 1.25**0.5, 0.0),
        (10.0, 0.25 / 100.25, 5.0 / 100.25**0.5, 1 / 100.25**0.5, 2.302585 / 4),
    ],
)
def test_edm_coefficients(sigma, c_skip, c_out, c_in, c_noise):
    got = DiffusionBlock.coefficients(torch.tensor(sigma), 0.5)
    assert [g.item() for g in got] == pytest.approx([c_skip, c_out, c_in, c_noise], rel=1e-5)
    assert loss_weight(torch.tensor(sigma), 0.5).item() == pytest.approx((sigma**2 + 0.25) / (0.25 * sigma**2))
