"""`bench/memory.py --preset ci`: every trainer measured in its own process, ratios against the reference."""

from __future__ import annotations

import json

import pytest
import torch

from spheroid.train import kept_for_backward

from .conftest import run_bench


def test_saved_tensors_are_counted_once_per_storage():
    x = torch.randn(64, 64, requires_grad=True)  # 16 KiB
    # exp keeps its output; mul keeps both operands: x (a leaf, counted once however often it is kept)
    # and y, which is exp's output
    out, kept = kept_for_backward(lambda: (x.exp() * x).sum())
    assert kept == 2 * 64 * 64 * 4
    _, none = kept_for_backward(lambda: (x + 1).sum())  # an addition keeps nothing
    assert none == 0 and out.requires_grad


def test_memory_bench_ci_preset(tmp_path, data_dir):
    out = tmp_path / "memory.json"
    proc = run_bench("memory.py", "--preset", "ci", "--batches", "8", "--steps", "2", "--out", str(out),
                     "--data", str(data_dir))
    rows = {r["trainer"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"reference", "reference-two-stream", "reference-1block", "block", "block-merged",
                         "last-block"}
    for r in rows.values():
        assert 0 < r["runtime_mb"] <= r["before_mb"] <= r["peak_mb"]
        assert r["activations_mb"] > 0 and r["weights_mb"] > 0
    assert rows["reference"]["peak_ratio"] == pytest.approx(1.0)
    # a block (its two streams) keeps less than the whole depth; the merged layout, one stream, less still
    kept = {name: r["activations_mb"] for name, r in rows.items()}
    assert kept["block-merged"] < kept["block"] < kept["reference"]
    assert rows["block"]["parameters"] < rows["reference"]["parameters"]
    # the last block also runs the three frozen blocks before it: their weights, without gradients or moments
    assert rows["last-block"]["frozen_mb"] == pytest.approx(3 * rows["block"]["weights_mb"] / 4, rel=0.01)
    assert rows["block"]["frozen_mb"] == 0
    assert "training memory, preset ci" in proc.stdout
