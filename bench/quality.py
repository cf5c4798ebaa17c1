"""Quality benchmark: BlockTrain against its end-to-end references, same data, optimizer and schedule.

Trains, each in its own process (so each trainer's peak memory is its own):
  - the end-to-end reference, depth n_blocks x layers_per_block, S steps;
  - the one-block-deep reference (what one worker could train alone), S steps;
  - the n_blocks blocks, S steps each;
then evaluates every snapshot on wiki.valid.tokens (the final one also on wiki.valid.raw): the chain
from pure noise with a clean context at M = 1 and M = 8 draws, block 0 alone, and both references.
Writes JSON (--out), a PNG of validation CE against training FLOPs, and prints a table.

    python bench/quality.py --preset ci|small|paper [--out FILE] [--work DIR] [--data DIR] [--device D]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from spheroid.config import ModelConfig, NoiseConfig, RunConfig, TrainConfig
from spheroid.data import fixed_windows, load_bytes
from spheroid.train import evaluate_chain, evaluate_reference, pick_device

log = logging.getLogger("bench.quality")

PRESETS: dict[str, dict] = {
    # a smoke run for the test suite: minutes on two cores, numbers meaningless
    "ci": {"model": {"d_model": 32, "n_heads": 2, "layers_per_block": 1, "context": 32},
           "train": {"steps": 40, "batch": 8, "warmup": 10}, "eval_windows": 32, "snapshots": 2, "jobs": 1},
    # about 30 to 45 minutes on a 2-core CPU
    "small": {"model": {"d_model": 128, "n_heads": 4, "layers_per_block": 2, "context": 128},
              "train": {"steps": 1000, "batch": 32, "warmup": 100}, "eval_windows": 256, "snapshots": 4, "jobs": 1},
    # one H100/H200-class GPU; all six trainers share the GPU at once
    "paper": {"model": {"d_model": 384, "n_heads": 6, "layers_per_block": 2, "context": 256},
              "train": {"steps": 4000, "batch": 64, "warmup": 200}, "eval_windows": 1024, "snapshots": 4, "jobs": 6},
}
DRAWS = 8


def preset_config(name: str, settings: list[str] = ()) -> RunConfig:
    """The preset's configuration with `group.field=value` settings on top (value parsed as JSON)."""
    p = PRESETS[name]
    groups = {"model": dict(p["model"]), "noise": {}, "train": dict(p["train"])}
    for item in settings:
        key, sep, value = item.partition("=")
        group, _, field = key.partition(".")
        if not sep or group not in groups or not field:
            raise SystemExit(f"--set wants GROUP.FIELD=VALUE with GROUP in {sorted(groups)}, got {item!r}")
        try:
            groups[group][field] = json.loads(value)
        except json.JSONDecodeError:
            groups[group][field] = value
    return RunConfig(model=ModelConfig(**groups["model"]), noise=NoiseConfig(**groups["noise"]),
                     train=TrainConfig(**groups["train"]))


def run_trainer(args: list[str], log_path: Path) -> None:
    """One trainer as its own process through the CLI; its log goes to a file and to stderr."""
    cmd = [sys.executable, "-m", "spheroid", "train", *args]
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            logf.write(line)
            sys.stderr.write(line)
        if proc.wait() != 0:
            raise RuntimeError(f"trainer failed ({' '.join(cmd)}); see {log_path}")


def train_all(cfg: RunConfig, work: Path, data: str | None, device: str | None, jobs: int, save_every: int) -> dict:
    """Train the two references and every block, `jobs` processes at a time; returns their metrics."""
    cfg_file = work / "config.json"
    cfg_file.write_text(cfg.to_json())
    common = ["--config", str(cfg_file), "--save-every", str(save_every)]
    if data:
        common += ["--data", data]
    if device:
        common += ["--device", device]
    runs = {
        "reference": ["--reference", "--out", str(work / "reference")],
        "single_block_reference": ["--reference", "--n-blocks", "1", "--out", str(work / "reference_1block")],
        **{f"block_{b}": ["--block", str(b), "--out", str(work / "blocktrain")] for b in range(cfg.model.n_blocks)},
    }
    (work / "logs").mkdir(exist_ok=True)

    def one(names: list[str]) -> dict:
        out = {}
        for name in names:
            metrics = work / "logs" / f"{name}.metrics.json"
            run_trainer([*runs[name], *common, "--metrics", str(metrics)], work / "logs" / f"{name}.log")
            out[name] = json.loads(metrics.read_text())
        return out

    # chain-state training needs the earlier blocks trained first: then the blocks run in order
    blocks = [n for n in runs if n.startswith("block_")]
    groups = [[n] for n in runs if n not in blocks]
    groups += [blocks] if cfg.train.block_input == "chain" else [[n] for n in blocks]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return {k: v for done in pool.map(one, groups) for k, v in done.items()}


def snapshot(folder: Path, step: int, final_step: int) -> Path:
    return folder if step == final_step else folder / "steps" / f"{step:06d}"


def evaluate_all(cfg: RunConfig, work: Path, steps: list[int], data: str | None, device: torch.device,
                 windows: int, metrics: dict) -> tuple[list[dict], dict]:
    """Validation CE of every model at every snapshot, and the final models on the raw split too."""
    ctx = cfg.model.context
    splits = {v: fixed_windows(load_bytes(data, "valid", v), windows, ctx + 1) for v in ("tokens", "raw")}
    block_flops = sum(metrics[f"block_{b}"]["flops_per_step"] for b in range(cfg.model.n_blocks))
    curve = []
    for step in steps:
        t0 = time.monotonic()
        chain, alone = evaluate_chain(snapshot(work / "blocktrain", step, steps[-1]), splits["tokens"], DRAWS, 0,
                                      device)
        row = {
            "step": step,
            "reference_ce": evaluate_reference(snapshot(work / "reference", step, steps[-1]), splits["tokens"], device),
            "single_block_reference_ce": evaluate_reference(
                snapshot(work / "reference_1block", step, steps[-1]), splits["tokens"], device),
            "blocktrain_ce": chain.ce_one_draw,
            "blocktrain_ce_m8": chain.ce_averaged,
            "block0_alone_ce": alone,
            "reference_flops": metrics["reference"]["flops_per_step"] * step,
            "single_block_reference_flops": metrics["single_block_reference"]["flops_per_step"] * step,
            "blocktrain_flops": block_flops * step,
        }
        curve.append(row)
        log.info("eval step %d: reference %.4f, one-block reference %.4f, chain M=1 %.4f, M=%d %.4f, "
                 "block 0 alone %.4f (%.0fs)", step, row["reference_ce"], row["single_block_reference_ce"],
                 row["blocktrain_ce"], DRAWS, row["blocktrain_ce_m8"], alone, time.monotonic() - t0)
    chain, alone = evaluate_chain(work / "blocktrain", splits["raw"], DRAWS, 0, device)
    raw = {
        "reference_ce": evaluate_reference(work / "reference", splits["raw"], device),
        "single_block_reference_ce": evaluate_reference(work / "reference_1block", splits["raw"], device),
        "blocktrain_ce": chain.ce_one_draw,
        "blocktrain_ce_m8": chain.ce_averaged,
        "block0_alone_ce": alone,
    }
    return curve, raw


def plot(curve: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [("reference", "reference_flops", "reference_ce"),
              ("one-block-deep reference", "single_block_reference_flops", "single_block_reference_ce"),
              ("BlockTrain chain, M = 1", "blocktrain_flops", "blocktrain_ce"),
              (f"BlockTrain chain, M = {DRAWS}", "blocktrain_flops", "blocktrain_ce_m8")]
    for label, fx, fy in series:
        ax.plot([r[fx] for r in curve], [r[fy] for r in curve], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs (all trainers of the model)")
    ax.set_ylabel("validation CE, nats/byte (wiki.valid.tokens)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="ci")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default bench/results/quality-<preset>.json)")
    parser.add_argument("--work", type=Path, default=None, help="checkpoints and logs (default runs/quality-<preset>)")
    parser.add_argument("--data", default=os.environ.get("SPHEROID_DATA"), help="WikiText folder")
    parser.add_argument("--device", default=None, help="torch device (default cuda when present)")
    parser.add_argument("--jobs", type=int, default=None, help="trainer processes at once (default: the preset's)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="GROUP.FIELD=VALUE",
                        help="change the preset's configuration, e.g. --set model.layout=merged (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    p = PRESETS[args.preset]
    cfg = preset_config(args.preset, args.settings)
    out = args.out or Path("bench/results") / f"quality-{args.preset}.json"
    work = args.work or Path("runs") / f"quality-{args.preset}"
    work.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = pick_device(args.device)
    steps_total = cfg.train.steps
    save_every = steps_total // p["snapshots"]
    steps = [save_every * i for i in range(1, p["snapshots"])] + [steps_total]
    jobs = args.jobs or p["jobs"]

    started = time.monotonic()
    log.info("preset %s: training 2 references and %d blocks, %d steps each, %d at a time, on %s",
             args.preset, cfg.model.n_blocks, steps_total, jobs, device)
    metrics = train_all(cfg, work, args.data, str(device), jobs, save_every)
    train_s = time.monotonic() - started
    curve, raw = evaluate_all(cfg, work, steps, args.data, device, p["eval_windows"], metrics)
    final = curve[-1]
    blocks = [metrics[f"block_{b}"] for b in range(cfg.model.n_blocks)]
    result = {
        "preset": args.preset,
        "split": "wiki.valid.tokens",
        "eval_windows": p["eval_windows"],
        "eval_bytes": p["eval_windows"] * cfg.model.context,
        "draws_m8": DRAWS,
        "reference_ce": final["reference_ce"],
        "single_block_reference_ce": final["single_block_reference_ce"],
        "blocktrain_ce": final["blocktrain_ce"],
        "blocktrain_ce_m8": final["blocktrain_ce_m8"],
        "block0_alone_ce": final["block0_alone_ce"],
        "gap": final["blocktrain_ce_m8"] - final["reference_ce"],
        "gap_to_single_block_reference": final["blocktrain_ce_m8"] - final["single_block_reference_ce"],
        "raw": raw,
        "wall_s": {
            "reference": metrics["reference"]["wall_s"],
            "single_block_reference": metrics["single_block_reference"]["wall_s"],
            "blocks": [m["wall_s"] for m in blocks],
            "blocktrain_sum": sum(m["wall_s"] for m in blocks),
            "training_total": train_s,
            "concurrent_trainers": jobs,
        },
        "flops": {
            "reference": final["reference_flops"],
            "single_block_reference": final["single_block_reference_flops"],
            "blocktrain": final["blocktrain_flops"],
            "per_block": [m["flops_per_step"] * steps_total for m in blocks],
        },
        "peak_rss_block_mb": max(m["peak_rss_mb"] for m in blocks),
        "peak_rss_reference_mb": metrics["reference"]["peak_rss_mb"],
        "peak_gpu_block_mb": max(m["peak_gpu_mb"] for m in blocks),  # torch's allocations; 0 on the CPU
        "peak_gpu_reference_mb": metrics["reference"]["peak_gpu_mb"],
        "rss_before_training_block_mb": max(m["rss_before_training_mb"] for m in blocks),
        "rss_before_training_reference_mb": metrics["reference"]["rss_before_training_mb"],
        "curve": curve,
        "config": cfg.to_dict(),
        "device": str(device),
        "torch": torch.__version__,
        "host": platform.node(),
        "total_s": time.monotonic() - started,
    }
    block_train_mb = result["peak_rss_block_mb"] - result["rss_before_training_block_mb"]
    ref_train_mb = result["peak_rss_reference_mb"] - result["rss_before_training_reference_mb"]
    result["peak_rss_ratio"] = result["peak_rss_block_mb"] / result["peak_rss_reference_mb"]
    result["training_rss_ratio"] = block_train_mb / ref_train_mb if ref_train_mb > 0 else None
    out.write_text(json.dumps(result, indent=2))
    png = out.with_suffix(".png")
    plot(curve, png, f"quality, preset {args.preset}")
    print_table(result)
    print(f"\nJSON: {out}\nplot: {png}\ncheckpoints: {work}")
    return result


def print_table(r: dict) -> None:
    w = r["wall_s"]
    rows = [
        ("end-to-end reference", r["reference_ce"], r["raw"]["reference_ce"], w["reference"], r["flops"]["reference"]),
        ("one-block-deep reference", r["single_block_reference_ce"], r["raw"]["single_block_reference_ce"],
         w["single_block_reference"], r["flops"]["single_block_reference"]),
        ("BlockTrain chain, M = 1", r["blocktrain_ce"], r["raw"]["blocktrain_ce"], w["blocktrain_sum"],
         r["flops"]["blocktrain"]),
        (f"BlockTrain chain, M = {r['draws_m8']}", r["blocktrain_ce_m8"], r["raw"]["blocktrain_ce_m8"],
         w["blocktrain_sum"], r["flops"]["blocktrain"]),
        ("block 0 alone (sigma_max)", r["block0_alone_ce"], r["raw"]["block0_alone_ce"], w["blocks"][0],
         r["flops"]["per_block"][0]),
    ]
    print(f"\n{'model':<28} {'CE valid.tokens':>15} {'CE valid.raw':>13} {'train s':>9} {'train FLOPs':>12}")
    for name, ce, ce_raw, wall, flops in rows:
        print(f"{name:<28} {ce:>15.4f} {ce_raw:>13.4f} {wall:>9.1f} {flops:>12.3e}")
    print(f"gap (M = {r['draws_m8']} minus reference): {r['gap']:+.4f} nats/byte")
    print(f"peak RSS: block worker {r['peak_rss_block_mb']:.0f} MiB, reference trainer "
          f"{r['peak_rss_reference_mb']:.0f} MiB (ratio {r['peak_rss_ratio']:.2f}; above the "
          f"{r['rss_before_training_reference_mb']:.0f} MiB held before training: "
          f"{r['training_rss_ratio'] or float('nan'):.2f})")
    if r["peak_gpu_reference_mb"]:
        print(f"peak GPU memory: block worker {r['peak_gpu_block_mb']:.0f} MiB, reference trainer "
              f"{r['peak_gpu_reference_mb']:.0f} MiB (ratio {r['peak_gpu_block_mb'] / r['peak_gpu_reference_mb']:.2f})")


if __name__ == "__main__":
    main()
