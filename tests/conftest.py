"""Shared fixtures: the real WikiText folder and a tiny model configuration for fast tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from spheroid.config import ModelConfig, NoiseConfig, RunConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[1]

# One torch thread in the test processes and every process they start (the CLI's trainers, eval,
# generate; nodes take --threads, 1 by default): the same arithmetic, hence the same weights, in
# every run of a command (tests compare them); and the suite runs two test processes on machines of
# about two cores, and torch's default of a thread per core has each thread spin-wait for the
# others while another process holds the cores. Measured beside two CPU hogs: the two-level error
# feedback test in test_averaging.py took 28 s of CPU with the default, 5.6 s with one thread.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files that run a benchmark's smoke preset first, then the others by their number of tests, the
    most first. The suite runs whole files in two processes (`--dist loadfile`) in this order
    (`--no-loadscope-reorder`: xdist's own order is by number of tests alone, which puts those files,
    a test or two of a minute each, last, where one ran alone while the other process had nothing
    left)."""
    per_file = Counter(item.path for item in items)
    items.sort(key=lambda item: (not item.path.name.endswith("_bench.py"), -per_file[item.path]))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The WikiText-2 folder: $SPHEROID_DATA, else ../shared/data/wikitext beside the checkout."""
    folder = Path(os.environ.get("SPHEROID_DATA") or ROOT.parent / "shared" / "data" / "wikitext")
    assert (folder / "wiki.valid.tokens.xz").exists() or (folder / "wiki.valid.tokens").exists(), (
        f"WikiText-2 not found in {folder}: set SPHEROID_DATA to the folder"
    )
    return folder


@pytest.fixture
def tiny() -> RunConfig:
    """A model small enough that a training step takes milliseconds on a CPU."""
    return RunConfig(
        model=ModelConfig(d_model=32, n_heads=2, layers_per_block=1, n_blocks=4, context=16),
        noise=NoiseConfig(),
        train=TrainConfig(steps=3, batch=4, warmup=1),
    )


def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter random values, so zero-initialised gates cannot hide a dependency."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


def run_bench(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run bench/<script> in its own process; assert it succeeded (showing its output if not)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc
