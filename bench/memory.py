"""Training memory: one block worker against the end-to-end reference trainer, and where it goes.

Each trainer runs in its own process through the library's own trainer (`train_block` /
`train_reference`, as `spheroid train` does) for a few steps at a preset's shapes, so its peak
resident memory is its own. Then, in the same process, one more step is taken apart:

  runtime       resident memory once Python, torch and spheroid are imported (before any data)
  before        peak resident memory before the first step (runtime, corpus, model, batch)
  peak          peak resident memory of the whole run
  training      peak - before: what training itself added
  activations   tensors autograd keeps for backward in one step (saved-tensor hooks, each storage once)
  weights       parameters + gradients + AdamW moments
  frozen        parameters of the frozen earlier blocks a block trainer runs (no gradients, no moments)

Trainers: `reference` (the plain end-to-end reference, full depth), `reference-two-stream` (the
same depth in the blocks' two-stream layout), `reference-1block` (the plain one-block-deep
reference: what one worker could train alone), `block` (block 0 with noised inputs, the concat
layout computed as two streams: what a swarm node trains), `block-merged` (block 0 with the K = 1
merged layout: one token per position) and `last-block` (the last block as the default trains it:
on chain states, its clean stream relayed from the block before; it also holds and runs the frozen
blocks before it, forward only: `frozen` is their weights). Every ratio is against the plain
reference measured in the same run, at the same batch. The same shapes at a larger batch show how
the fixed runtime weighs. Writes JSON (--out; default runs/memory-<preset>.json: the committed
results were written with --out bench/results/...), with the commit and command that made it.

    python bench/memory.py [--preset ci|small] [--batches 32,128] [--steps 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402
from quality import PRESETS, preset_config  # noqa: E402

from spheroid import train  # noqa: E402
from spheroid.config import RunConfig, override  # noqa: E402
from spheroid.data import load_bytes, random_windows  # noqa: E402
from spheroid.model import Reference  # noqa: E402

log = logging.getLogger("bench.memory")

# name -> (what trains: "reference" or the index of a block, model changes, training changes)
NOISED = {"block_input": "noised"}
TRAINERS = {
    "reference": ("reference", {}, {}),
    "reference-two-stream": ("reference", {"reference_layout": "two_stream"}, {}),
    "reference-1block": ("reference", {"n_blocks": 1}, {}),
    "block": (0, {}, NOISED),
    "block-merged": (0, {"layout": "merged", "channel": "z"}, NOISED),
    # the earlier blocks in their genesis states (published ones are never read within the run):
    # the same memory as trained ones, without training them first
    "last-block": (-1, {}, {"block_input": "chain", "refresh_every": 1_000_000}),
}
MIB = 2**20


def resident_mb() -> float:
    """This process's resident memory now, in MiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status: this benchmark reads Linux's process accounting")


def measure(kind: str | int, cfg: RunConfig, data_dir: str | None) -> dict:
    """One trainer ("reference" or a block's index), in this process: the real training loop for
    cfg.train.steps, then one step taken apart."""
    runtime = resident_mb()
    data = load_bytes(data_dir, "train")
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "reference":
            fit = train.train_reference(cfg, data, Path(tmp), device)
        else:
            fit = train.train_block(cfg, kind, data, Path(tmp), device)

        # the breakdown comes after the run, so it cannot add to the peak measured above
        gen = torch.Generator().manual_seed(cfg.train.seed)
        earlier = None
        if kind == "reference":
            model = Reference(cfg.model)
            loss_fn = train.reference_loss(model)
        else:
            model, loss_fn, earlier = train.block_trainer(cfg, kind, Path(tmp), device)
    opt = train.make_optimizer(model, cfg)
    windows = random_windows(data, cfg.train.batch, cfg.model.context + 1, gen)
    train.train_step(model, loss_fn, opt, windows, gen, cfg.train.grad_clip)  # AdamW state exists from here
    (loss, _), activations = train.kept_for_backward(lambda: loss_fn(windows, gen))
    loss.backward()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim() > 0)
    frozen = sum(p.numel() * p.element_size() for b in (earlier.blocks if earlier else []) for p in b.parameters())
    return {
        "runtime_mb": runtime,
        "frozen_mb": frozen / MIB,
        "before_mb": fit.rss_before_training_mb,
        "peak_mb": fit.peak_rss_mb,
        "training_mb": fit.peak_rss_mb - fit.rss_before_training_mb,
        "activations_mb": activations / MIB,
        "weights_mb": (2 * params + moments) / MIB,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def run_child(kind: str, cfg: RunConfig, data_dir: str | None) -> dict:
    """`measure` in a fresh process, so that each trainer's peak memory is its own."""
    spec = json.dumps({"kind": kind, "config": json.loads(cfg.to_json()), "data": data_dir})
    proc = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(preset: str, batches: list[int], steps: int, data_dir: str | None) -> dict:
    preset_cfg = preset_config(preset)
    rows, ideal = [], {}
    for batch in batches:
        base = dataclasses.replace(preset_cfg, train=override(preset_cfg.train, batch=batch, steps=steps, warmup=1))
        measured = {}
        for name, (kind, model_changes, train_changes) in TRAINERS.items():
            cfg = dataclasses.replace(base, model=override(base.model, **model_changes),
                                      train=override(base.train, **train_changes))
            kind = base.model.n_blocks + kind if isinstance(kind, int) and kind < 0 else kind
            log.info("batch %d: %s ...", batch, name)
            measured[name] = {"trainer": name, "batch": batch, **run_child(kind, cfg, data_dir)}
        ref = measured["reference"]
        for row in measured.values():
            for key in ("peak", "training", "activations"):
                row[f"{key}_ratio"] = row[f"{key}_mb"] / ref[f"{key}_mb"]
        rows += measured.values()
        # arithmetic on the figures above, not a measurement: a block holding exactly 1/B of the
        # reference's training memory, on the same runtime
        ideal[batch] = (ref["before_mb"] + ref["training_mb"] / base.model.n_blocks) / ref["peak_mb"]
    return {"preset": preset, "steps": steps, "config": json.loads(preset_cfg.to_json()),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows,
            "ideal_block_peak_ratio": ideal}


def print_table(result: dict) -> None:
    print(f"\ntraining memory, preset {result['preset']} ({result['steps']} steps each, own process; MiB)")
    head = ("trainer", "batch", "runtime", "before", "peak", "training", "activations", "weights", "frozen",
            "peak/ref", "training/ref", "activ./ref")
    print(f"{head[0]:>20}" + "".join(f"{h:>13}" for h in head[1:]))
    for r in result["rows"]:
        cells = (r["trainer"], r["batch"], *(f"{r[k]:.0f}" for k in (
            "runtime_mb", "before_mb", "peak_mb", "training_mb", "activations_mb")), f"{r['weights_mb']:.1f}",
            f"{r['frozen_mb']:.1f}", *(f"{r[k]:.2f}" for k in ("peak_ratio", "training_ratio", "activations_ratio")))
        print(f"{cells[0]:>20}" + "".join(f"{c:>13}" for c in cells[1:]))
    for batch, ideal in result["ideal_block_peak_ratio"].items():
        print(f"batch {batch}: a block with exactly 1/{result['config']['model']['n_blocks']} of the reference's "
              f"training memory, on the same runtime, would peak at {ideal:.2f} of the reference")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # CPU presets: resident memory is what a CPU process holds (on a GPU, quality.py records torch's peak)
    parser.add_argument("--preset", choices=["ci", "small", "depth"], default="small")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default: the preset's, and 4x)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per trainer")
    parser.add_argument("--data", default=None, help="WikiText folder (default: $SPHEROID_DATA)")
    parser.add_argument("--out", default=None,
                        help="JSON file (default: runs/memory-<preset>.json; pass bench/results/... to commit one)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(measure(spec["kind"], RunConfig.from_dict(spec["config"]), spec["data"])))
        return
    batch = PRESETS[args.preset]["train"]["batch"]
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [batch, 4 * batch]
    result = {**provenance(), **run(args.preset, batches, args.steps, args.data)}
    out = Path(args.out or Path("runs") / f"memory-{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
