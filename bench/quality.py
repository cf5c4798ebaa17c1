"""Quality benchmark: BlockTrain against its end-to-end references, same data, optimizer and schedule.

Trains, each in its own process (so each trainer's peak memory is its own), S steps each:
  - four end-to-end references, {plain, two-stream} x {full depth n_blocks x layers_per_block, one
    block's depth}: the plain causal transformer, and the blocks' own two-stream layout with nothing
    noisy in it (so a gap measures the training method, not the layout);
  - the n_blocks blocks in order (block b reads the trained, frozen blocks 0..b-1);
  - with the preset's refresh_every R > 0, the blocks again, all at once, each reading the newest
    published snapshots of the earlier blocks every R steps, as a swarm trains them;
then evaluates on wiki.valid.tokens (the final models also on wiki.valid.raw): the chain from pure
noise with a clean context at M = 1 and M = 8 draws, block 0 alone, and every reference. The gap is
measured to the best full-depth reference; what one worker could train alone is the best of the
one-block-deep references and block 0 alone. Writes JSON (--out; default runs/quality-<preset>.json:
the committed results were written with --out bench/results/...), with the commit and command that
made it, a PNG of validation CE against training FLOPs, and prints a table.

    python bench/quality.py --preset ci|small|depth|paper [--out FILE] [--work DIR] [--data DIR] [--device D]
                            [--set GROUP.FIELD=VALUE] [--reuse-references EARLIER_WORK]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from provenance import provenance

from spheroid.config import ModelConfig, NoiseConfig, RunConfig, TrainConfig
from spheroid.data import fixed_windows, load_bytes
from spheroid.train import evaluate_chain, evaluate_reference, pick_device

log = logging.getLogger("bench.quality")

PRESETS: dict[str, dict] = {
    # a smoke run for the test suite: minutes on two cores, numbers meaningless
    "ci": {"model": {"d_model": 32, "n_heads": 2, "layers_per_block": 1, "context": 32},
           "train": {"steps": 40, "batch": 8, "warmup": 10}, "eval_windows": 32, "snapshots": 2, "jobs": 2,
           "refresh_every": 10},
    # about 45 minutes on a 2-core CPU
    "small": {"model": {"d_model": 128, "n_heads": 4, "layers_per_block": 2, "context": 128},
              "train": {"steps": 1000, "batch": 32, "warmup": 100}, "eval_windows": 256, "snapshots": 4, "jobs": 1,
              "refresh_every": 0},
    # where depth pays on a 2-core CPU within 2 hours: 4 blocks of one layer, so the full-depth
    # references are 4 layers deep and the one-block-deep ones 1 (no 1-layer model forms the
    # two-layer circuits, such as induction heads, that a 4-layer one does). Plain references at
    # these shapes, 3000-step schedule: 4 layers 1.5596 / 1.3341 at steps 1000 / 2000, 1 layer
    # 1.6082 / 1.4551 (depth worth 0.049, then 0.121)
    "depth": {"model": {"d_model": 128, "n_heads": 4, "layers_per_block": 1, "context": 128},
              "train": {"steps": 2000, "batch": 32, "warmup": 200, "lr": 2e-3}, "eval_windows": 256,
              "snapshots": 4, "jobs": 2, "refresh_every": 100},
    # one H100/H200-class GPU; all trainers share the GPU at once
    "paper": {"model": {"d_model": 384, "n_heads": 6, "layers_per_block": 2, "context": 256},
              "train": {"steps": 4000, "batch": 64, "warmup": 200}, "eval_windows": 1024, "snapshots": 4, "jobs": 8,
              "refresh_every": 200},
}
DRAWS = 8
# the references: name -> (checkpoint folder, `spheroid train` flags)
REFERENCES = {
    "reference": ("reference", []),
    "single_block_reference": ("reference_1block", ["--n-blocks", "1"]),
    "reference_two_stream": ("reference_two_stream", ["--reference-layout", "two_stream"]),
    "single_block_reference_two_stream": ("reference_two_stream_1block",
                                          ["--reference-layout", "two_stream", "--n-blocks", "1"]),
}
FULL_DEPTH = ("reference", "reference_two_stream")
ONE_BLOCK_DEEP = ("single_block_reference", "single_block_reference_two_stream")
# the block schedules: name -> checkpoint folder
CHAINS = {"ordered": "blocktrain", "concurrent": "blocktrain_concurrent"}


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


def run_trainer(args: list[str], log_path: Path, threads: int) -> subprocess.Popen:
    """Start one trainer as its own process through the CLI; its log goes to a file."""
    cmd = [sys.executable, "-m", "spheroid", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    logf = open(log_path, "w")  # noqa: SIM115 (closed by wait_for)
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, text=True, env=env)
    proc.log = logf
    return proc


def wait_for(procs: list[subprocess.Popen], logs: list[Path], every: float = 60.0) -> None:
    """Wait for the trainers, logging each one's latest progress line (step, loss, eta) every minute."""
    while any(proc.poll() is None for proc in procs):
        time.sleep(min(every, 5.0))
        if time.monotonic() % every < 5.0:
            for proc, log_path in zip(procs, logs, strict=True):
                lines = [line for line in log_path.read_text(errors="replace").splitlines() if " step " in line]
                if proc.poll() is None and lines:
                    log.info("%s: %s", log_path.stem, lines[-1].split(": ", 1)[-1])
    for proc, log_path in zip(procs, logs, strict=True):
        code = proc.wait()
        proc.log.close()
        if code != 0:
            raise RuntimeError(f"trainer failed ({' '.join(proc.args)}):\n{log_path.read_text()[-3000:]}")


def reuse_references(cfg: RunConfig, source: Path, work: Path) -> dict:
    """Copy the four references an earlier run trained in `source` into `work`; their metrics.

    Only a block's own settings may differ (the channel, the relay loss, the noise schedule, how
    blocks are fed): anything a reference's training depends on must match, or this refuses."""
    block_only = {"channel": cfg.model.channel, "relay_loss": cfg.model.relay_loss, "gate_init": cfg.model.gate_init,
                  "relay_head_hidden": cfg.model.relay_head_hidden, "noisy_anchor": cfg.model.noisy_anchor}
    metrics = {}
    for name, (folder, _) in REFERENCES.items():
        record = source / folder / "reference.json"
        if not record.exists():
            raise SystemExit(f"--reuse-references: {record} is missing; train the references there first")
        trained = RunConfig.from_dict(json.loads(record.read_text())["config"])
        expected = dataclasses.replace(cfg.model, n_blocks=1 if name in ONE_BLOCK_DEEP else cfg.model.n_blocks,
                                       reference_layout="two_stream" if "two_stream" in name else "plain")
        same_train = dataclasses.replace(trained.train, refresh_every=cfg.train.refresh_every,
                                         block_input=cfg.train.block_input, noisy_positions=cfg.train.noisy_positions,
                                         init_from_previous=cfg.train.init_from_previous) == cfg.train
        if dataclasses.replace(trained.model, **block_only) != expected or not same_train:
            raise SystemExit(f"--reuse-references: {source / folder} was trained with another configuration "
                             f"({trained.model}, {trained.train}); retrain without --reuse-references")
        if (work / folder).resolve() != (source / folder).resolve():
            shutil.rmtree(work / folder, ignore_errors=True)
            shutil.copytree(source / folder, work / folder)
        metrics[name] = json.loads((source / "logs" / f"{name}.metrics.json").read_text())
        log.info("reusing %s from %s", name, source / folder)
    (work / "logs").mkdir(exist_ok=True)
    for name, value in metrics.items():
        (work / "logs" / f"{name}.metrics.json").write_text(json.dumps(value))
    return metrics


def train_all(cfg: RunConfig, work: Path, data: str | None, device: str | None, jobs: int, save_every: int,
              refresh_every: int, trained: dict) -> dict:
    """Train the references and the blocks, `jobs` at a time; returns their metrics by run name.

    The blocks in order are one sequence (each reads the ones before it); the blocks all at once
    start together (each reading the others' published snapshots), counting as one job per block.
    Runs named in `trained` (reused references) are not trained again.
    """
    cfg_file = work / "config.json"
    cfg_file.write_text(cfg.to_json())
    common = ["--config", str(cfg_file), "--save-every", str(save_every)]
    if data:
        common += ["--data", data]
    if device:
        common += ["--device", device]
    runs = {name: ["--reference", "--out", str(work / folder), *flags] for name, (folder, flags) in REFERENCES.items()}
    n = cfg.model.n_blocks
    runs.update({f"block_{b}": ["--block", str(b), "--out", str(work / CHAINS["ordered"])] for b in range(n)})
    # the longest sequence first: in order, block b reads the trained blocks before it
    groups = [[f"block_{b}" for b in range(n)], *([name] for name in REFERENCES if name not in trained)]
    if refresh_every:
        folder = work / CHAINS["concurrent"]
        shutil.rmtree(folder, ignore_errors=True)  # snapshots of an earlier run would be read as published
        runs.update({f"concurrent_block_{b}": ["--block", str(b), "--out", str(folder), "--refresh-every",
                                               str(refresh_every)] for b in range(n)})
        groups.append([f"concurrent_block_{b}" for b in range(n)])
    (work / "logs").mkdir(exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    slots = threading.Semaphore(jobs)

    def one(names: list[str]) -> dict:
        """Runs a group: the concurrent blocks all at once, any other group one after another."""
        together = names[0].startswith("concurrent_")
        batches = [names] if together else [[name] for name in names]
        for batch in batches:
            need = min(len(batch), jobs)
            for _ in range(need):
                slots.acquire()
            try:
                logs = [work / "logs" / f"{name}.log" for name in batch]
                procs = [run_trainer([*runs[name], *common, "--metrics", str(work / "logs" / f"{name}.metrics.json")],
                                     log_path, threads) for name, log_path in zip(batch, logs, strict=True)]
                log.info("started %s", ", ".join(batch))
                wait_for(procs, logs)
                log.info("finished %s", ", ".join(batch))
            finally:
                for _ in range(need):
                    slots.release()
        return {name: json.loads((work / "logs" / f"{name}.metrics.json").read_text()) for name in names}

    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        return {**trained, **{k: v for done in pool.map(one, groups) for k, v in done.items()}}


def snapshot(folder: Path, step: int, final_step: int) -> Path:
    return folder if step == final_step else folder / "steps" / f"{step:06d}"


def evaluate_all(cfg: RunConfig, work: Path, steps: list[int], data: str | None, device: torch.device,
                 windows: int, metrics: dict) -> tuple[list[dict], dict]:
    """Validation CE of every model at every snapshot, and the final models on the raw split too.

    A chain is only the chain as trained at the last step: before it, a block's snapshot read other
    versions of the blocks before it (trained in order: their final ones; all at once: whatever
    step the faster trainers had reached), so the chains' curves have the last point only.
    """
    ctx = cfg.model.context
    splits = {v: fixed_windows(load_bytes(data, "valid", v), windows, ctx + 1) for v in ("tokens", "raw")}
    chains = [name for name in CHAINS if (work / CHAINS[name]).exists()]
    curve = []
    for step in steps:
        t0 = time.monotonic()
        final = step == steps[-1]
        row: dict = {"step": step}
        for name, (folder, _) in REFERENCES.items():
            row[f"{name}_ce"] = evaluate_reference(snapshot(work / folder, step, steps[-1]), splits["tokens"], device)
            row[f"{name}_flops"] = metrics[name]["flops_per_step"] * step
        for chain in chains:
            prefix = "blocktrain" if chain == "ordered" else "concurrent"
            runs = [f"block_{b}" if chain == "ordered" else f"concurrent_block_{b}" for b in range(cfg.model.n_blocks)]
            row[f"{prefix}_flops"] = sum(metrics[r]["flops_per_step"] for r in runs) * step
            if not final:
                continue
            ce, alone = evaluate_chain(snapshot(work / CHAINS[chain], step, steps[-1]), splits["tokens"], DRAWS, 0,
                                       device)
            row.update({f"{prefix}_ce": ce.ce_one_draw, f"{prefix}_ce_m8": ce.ce_averaged,
                        f"{prefix}_block0_alone_ce": alone})
        curve.append(row)
        log.info("eval step %d: %s (%.0fs)", step, ", ".join(f"{k} {v:.4f}" for k, v in row.items()
                                                             if k.endswith("_ce") or k.endswith("_m8")),
                 time.monotonic() - t0)
    raw = {f"{name}_ce": evaluate_reference(work / folder, splits["raw"], device)
           for name, (folder, _) in REFERENCES.items()}
    for chain in chains:
        prefix = "blocktrain" if chain == "ordered" else "concurrent"
        ce, alone = evaluate_chain(work / CHAINS[chain], splits["raw"], DRAWS, 0, device)
        raw.update({f"{prefix}_ce": ce.ce_one_draw, f"{prefix}_ce_m8": ce.ce_averaged,
                    f"{prefix}_block0_alone_ce": alone})
    return curve, raw


def plot(curve: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [(label, f"{name}_flops", f"{name}_ce") for name, label in REFERENCE_LABELS.items()]
    series += [("BlockTrain in order, M = 1", "blocktrain_flops", "blocktrain_ce"),
               (f"BlockTrain in order, M = {DRAWS}", "blocktrain_flops", "blocktrain_ce_m8"),
               ("BlockTrain all at once, M = 1", "concurrent_flops", "concurrent_ce")]
    for label, fx, fy in series:
        points = [(r[fx], r[fy]) for r in curve if fy in r]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs (all trainers of the model)")
    ax.set_ylabel("validation CE, nats/byte (wiki.valid.tokens)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


REFERENCE_LABELS = {
    "reference": "reference, plain, full depth",
    "reference_two_stream": "reference, two-stream, full depth",
    "single_block_reference": "reference, plain, one block deep",
    "single_block_reference_two_stream": "reference, two-stream, one block deep",
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="ci")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default runs/quality-<preset>.json; pass bench/results/... to commit one)")
    parser.add_argument("--work", type=Path, default=None, help="checkpoints and logs (default runs/quality-<preset>)")
    parser.add_argument("--data", default=os.environ.get("SPHEROID_DATA"), help="WikiText folder")
    parser.add_argument("--device", default=None, help="torch device (default cuda when present)")
    parser.add_argument("--jobs", type=int, default=None, help="trainer processes at once (default: the preset's)")
    parser.add_argument("--refresh-every", type=int, default=None,
                        help="blocks all at once, reading the earlier blocks' snapshots every R steps "
                             "(default: the preset's; 0 = only in order)")
    parser.add_argument("--evaluate-only", action="store_true",
                        help="evaluate the models an earlier run trained into --work, without training")
    parser.add_argument("--reuse-references", type=Path, default=None, metavar="WORK",
                        help="take the four references from an earlier run's --work folder instead of training "
                             "them again (their configuration must match but for the blocks' own settings)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="GROUP.FIELD=VALUE",
                        help="change the preset's configuration, e.g. --set model.channel=z (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    p = PRESETS[args.preset]
    cfg = preset_config(args.preset, args.settings)
    out = args.out or Path("runs") / f"quality-{args.preset}.json"
    work = args.work or Path("runs") / f"quality-{args.preset}"
    work.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = pick_device(args.device)
    steps_total = cfg.train.steps
    save_every = steps_total // p["snapshots"]
    steps = [save_every * i for i in range(1, p["snapshots"])] + [steps_total]
    jobs = args.jobs or p["jobs"]
    refresh = p["refresh_every"] if args.refresh_every is None else args.refresh_every

    started = time.monotonic()
    log.info("preset %s: %s 4 references and %d blocks (in order%s), %d steps each, %d at a time, on %s",
             args.preset, "evaluating" if args.evaluate_only else "training" if not args.reuse_references
             else "reusing", cfg.model.n_blocks, f", and all at once reading snapshots every {refresh} steps"
             if refresh else "", steps_total, jobs, device)
    if args.evaluate_only:  # the trainers' own metrics, from the run that trained them
        metrics = {f.name.removesuffix(".metrics.json"): json.loads(f.read_text())
                   for f in (work / "logs").glob("*.metrics.json")}
    else:
        reused = reuse_references(cfg, args.reuse_references, work) if args.reuse_references else {}
        metrics = train_all(cfg, work, args.data, str(device), jobs, save_every, refresh, reused)
    train_s = None if args.evaluate_only else time.monotonic() - started
    curve, raw = evaluate_all(cfg, work, steps, args.data, device, p["eval_windows"], metrics)
    result = {**provenance(), **summarise(cfg, args.preset, p, curve, raw, metrics, jobs, refresh, train_s)}
    if args.reuse_references:
        # their wall_s are that run's; the folder as given, relative to the checkout when inside it
        reused_at = args.reuse_references.resolve()
        root = Path(__file__).resolve().parents[1]
        result["reused_references"] = str(reused_at.relative_to(root) if reused_at.is_relative_to(root)
                                          else args.reuse_references)
    result.update(device=str(device), torch=torch.__version__, host=platform.node(),
                  total_s=time.monotonic() - started)
    out.write_text(json.dumps(result, indent=2))
    png = out.with_suffix(".png")
    plot(curve, png, f"quality, preset {args.preset}")
    print_table(result)
    print(f"\nJSON: {out}\nplot: {png}\ncheckpoints: {work}")
    return result


def summarise(cfg: RunConfig, preset: str, p: dict, curve: list[dict], raw: dict, metrics: dict, jobs: int,
              refresh: int, train_s: float | None) -> dict:
    """The JSON of a run: the final figures, the best references, the bars' differences, costs."""
    final = curve[-1]
    n, steps = cfg.model.n_blocks, cfg.train.steps
    references = {
        name: {"ce": final[f"{name}_ce"], "ce_raw": raw[f"{name}_ce"], "params": metrics[name]["params"],
               "train_flops": metrics[name]["flops_per_step"] * steps, "wall_s": metrics[name]["wall_s"],
               "peak_rss_mb": metrics[name]["peak_rss_mb"], "peak_gpu_mb": metrics[name]["peak_gpu_mb"],
               "layout": "two_stream" if name.endswith("two_stream") else "plain",
               "depth": (1 if name in ONE_BLOCK_DEEP else n) * cfg.model.layers_per_block}
        for name in REFERENCES
    }
    best_full = min(FULL_DEPTH, key=lambda k: references[k]["ce"])
    best_single = min(ONE_BLOCK_DEEP, key=lambda k: references[k]["ce"])
    chains = {}
    for chain, prefix in (("ordered", "blocktrain"), ("concurrent", "concurrent")):
        if f"{prefix}_ce" not in final:
            continue
        blocks = [metrics[f"block_{b}" if chain == "ordered" else f"concurrent_block_{b}"] for b in range(n)]
        chains[chain] = {
            "ce": final[f"{prefix}_ce"], "ce_m8": final[f"{prefix}_ce_m8"],
            "block0_alone_ce": final[f"{prefix}_block0_alone_ce"],
            "raw": {k: raw[f"{prefix}_{k}"] for k in ("ce", "ce_m8", "block0_alone_ce")},
            "params": sum(m["params"] for m in blocks), "params_per_block": blocks[0]["params"],
            "train_flops": sum(m["flops_per_step"] for m in blocks) * steps,
            "train_flops_per_block": [m["flops_per_step"] * steps for m in blocks],
            "wall_s": [m["wall_s"] for m in blocks],
            "peak_rss_mb": max(m["peak_rss_mb"] for m in blocks),
            "rss_before_training_mb": max(m["rss_before_training_mb"] for m in blocks),
            "peak_gpu_mb": max(m["peak_gpu_mb"] for m in blocks),
        }
    ordered = chains["ordered"]
    alone_best = min(references[best_single]["ce"], ordered["block0_alone_ce"])
    result = {
        "preset": preset,
        "split": "wiki.valid.tokens",
        "eval_windows": p["eval_windows"],
        "eval_bytes": p["eval_windows"] * cfg.model.context,
        "draws_m8": DRAWS,
        # the bar's figures: the best full-depth and one-block-deep references, the chain in order
        "reference_ce": references[best_full]["ce"],
        "best_reference": best_full,
        "single_block_reference_ce": references[best_single]["ce"],
        "best_single_block_reference": best_single,
        "blocktrain_ce": ordered["ce"],
        "blocktrain_ce_m8": ordered["ce_m8"],
        "block0_alone_ce": ordered["block0_alone_ce"],
        "one_worker_alone_ce": alone_best,
        "depth_pays": references[best_single]["ce"] - references[best_full]["ce"],
        "gap": ordered["ce"] - references[best_full]["ce"],
        "gap_m8": ordered["ce_m8"] - references[best_full]["ce"],
        "composition": ordered["block0_alone_ce"] - ordered["ce"],
        "gain_over_one_worker": alone_best - ordered["ce"],
        "references": references,
        "chains": chains,
        "raw": raw,
        "refresh_every": refresh,
        "wall_s": {"training_total": train_s, "concurrent_trainers": jobs},
        "curve": curve,
        "config": cfg.to_dict(),
    }
    if "concurrent" in chains:
        result["concurrent_ce"] = chains["concurrent"]["ce"]
        result["concurrent_ce_m8"] = chains["concurrent"]["ce_m8"]
    plain = references["reference"]
    result["peak_rss_ratio"] = ordered["peak_rss_mb"] / plain["peak_rss_mb"]
    return result


def print_table(r: dict) -> None:
    print(f"\n{'model':<40} {'CE valid.tokens':>15} {'CE valid.raw':>13} {'params':>9} {'train s':>9} "
          f"{'train FLOPs':>12}")
    for name, label in REFERENCE_LABELS.items():
        ref = r["references"][name]
        label = f"{label} ({ref['depth']} layer{'' if ref['depth'] == 1 else 's'})"
        print(f"{label:<40} {ref['ce']:>15.4f} {ref['ce_raw']:>13.4f} {ref['params']:>9d} {ref['wall_s']:>9.1f} "
              f"{ref['train_flops']:>12.3e}")
    for chain, c in r["chains"].items():
        what = "in order" if chain == "ordered" else f"all at once (R = {r['refresh_every']})"
        wall = " + ".join(f"{w:.0f}" for w in c["wall_s"])
        rows = ((f"chain {what}, M = 1", c["ce"], c["raw"]["ce"], c["params"], wall, c["train_flops"]),
                (f"chain {what}, M = {r['draws_m8']}", c["ce_m8"], c["raw"]["ce_m8"], c["params"], wall,
                 c["train_flops"]),
                ("  its block 0 alone", c["block0_alone_ce"], c["raw"]["block0_alone_ce"], c["params_per_block"],
                 f"{c['wall_s'][0]:.0f}", c["train_flops_per_block"][0]))
        for label, ce, ce_raw, params, seconds, flops in rows:
            print(f"{label:<40} {ce:>15.4f} {ce_raw:>13.4f} {params:>9d} {seconds:>9} {flops:>12.3e}")
    print(f"\ndepth pays (best one-block-deep minus best full-depth reference): {r['depth_pays']:+.4f}")
    print(f"the blocks compose (block 0 alone minus chain, M = 1): {r['composition']:+.4f}")
    print(f"chain (M = 1) minus the best full-depth reference ({r['best_reference']}): {r['gap']:+.4f}")
    print("one worker alone (best of one-block-deep references, block 0) minus chain: "
          f"{r['gain_over_one_worker']:+.4f}")
    print(f"peak RSS: block worker {r['chains']['ordered']['peak_rss_mb']:.0f} MiB, plain full-depth reference "
          f"{r['references']['reference']['peak_rss_mb']:.0f} MiB (ratio {r['peak_rss_ratio']:.2f})")


if __name__ == "__main__":
    main()
