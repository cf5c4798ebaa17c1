"""BlockTrain against what a user would run instead, on the same work, through the same nodes.

Rows, all on the same model shape (the preset's), training data (random windows of
wiki.train.tokens) and total training compute:

  e2e         one worker trains the end-to-end reference (the plain causal transformer, all
              n_blocks x layers_per_block layers) alone: `spheroid train --reference`; no bytes
  diloco      N workers, N = the number of blocks, train replicas of that reference through nodes
              (`spheroid node --reference`): H local AdamW steps, then the change is averaged with
              a Nesterov outer step, in a codec with error feedback (lz4 on top); H, the outer
              learning rate and the codec are tuned by a coordinate search over a grid (every run
              of it is reported; the row is the best by final CE, chosen on the validation windows
              it is scored on, as bench/swarm.py's best BlockTrain configuration was)
  blocktrain  one worker per block through nodes (`spheroid node --block B`), bench/swarm.py's best
              configuration (int2 updates with error feedback every 100 steps, refreshes of the
              earlier blocks by their change in int2 at most every 300 steps; relay channel, gates
              at one: the current defaults)

Every node sits behind its own emulated WAN link (bench/wan.py; the swarm bench's default 20 ms one
way, 50 Mbit/s per direction), runs one torch thread, and its bytes are its own counters of what it
sent to other nodes. Compute is matched in FLOPs: before the runs the bench counts one training
step of every block and of the reference with torch's FLOP counter (the mean of several steps: the
last block's cost depends on the chain level drawn), then gives e2e and each diloco worker the steps
that make their total equal to the blocks' (blocktrain's steps per block x the sum of the blocks'
FLOPs per step). Afterwards the rows' FLOPs are the workers' own counts (`train_flops` in a node's
status, FLOPs per step x steps in the trainer's metrics), and the table says whether they lie
within 10% of each other.

Per row: final validation CE (M = 1 for the chain; 256 fixed windows of wiki.valid.tokens in the
default preset), CE against bytes and against FLOPs while training (snapshots assembled from the
running swarm), total bytes and the most any worker sent, total and per-worker FLOPs, the largest
peak RSS of any worker, each worker's training memory (weights, gradients, optimizer state,
activations kept for backward, frozen copies of earlier blocks: the node measures them at its first
steps) and wall time. Beside them, spheroid/projection.py's memory and traffic model at the bench's
own shape against these measurements, and at public model shapes.

Writes JSON (--out; by default runs/peers-<preset>/peers.json: the committed result is written
with `--out bench/results/peers.json`, then `make results`), a PNG of CE against bytes and FLOPs
beside it, and prints the tables.

    python bench/peers.py [--preset ci|default] [--out FILE] [--work DIR] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.utils import parameters_to_vector

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402
from swarm import CONFIGS, run_swarm  # noqa: E402
from wan import LinkSpec  # noqa: E402

from spheroid import checkpoint, projection, sizing  # noqa: E402
from spheroid.config import REFERENCE_PART, ModelConfig, RunConfig, TrainConfig  # noqa: E402
from spheroid.data import fixed_windows, load_bytes, random_windows  # noqa: E402
from spheroid.loading import block_from  # noqa: E402
from spheroid.train import costed_step, evaluate_chain, evaluate_reference, make_optimizer, part_trainer  # noqa: E402
from spheroid.wire.tensors import CODEC_OPTIONS, encode_tensor  # noqa: E402

log = logging.getLogger("bench.peers")

PRESETS: dict[str, dict] = {
    # a smoke run for the test suite: a minute or two, numbers meaningless
    "ci": {"model": {"d_model": 32, "n_heads": 2, "layers_per_block": 1, "context": 32, "n_blocks": 2},
           "train": {"batch": 8, "warmup": 10}, "block_steps": 40, "snapshot_s": 2.0, "windows": 16,
           "grid": {"every": [10], "outer_lr": [0.7], "codec": ["int4"]}},
    # bench/swarm.py's default shapes (8 layers of width 64, context 64, batch 16), 1600 steps per
    # block: about 70 minutes on a 2-core CPU
    "default": {"model": {"d_model": 64, "n_heads": 4, "layers_per_block": 2, "context": 64, "n_blocks": 4},
                "train": {"batch": 16, "warmup": 50}, "block_steps": 1600, "snapshot_s": 30.0, "windows": 256,
                # coordinate search: H first (at outer lr 0.7 and int4, DiLoCo's own setting), then the
                # outer learning rate at the best H, then the codec at both
                "grid": {"every": [25, 100], "outer_lr": [0.7, 1.0], "codec": ["int4", "int8"]}},
}
OUTER_MOMENTUM = 0.9  # DiLoCo's
FLOP_STEPS = 16  # training steps whose FLOPs are counted per trainer to match the budgets
MATCH = 0.10  # the rows' FLOPs must lie within this of each other


def preset_config(p: dict) -> RunConfig:
    return RunConfig(model=ModelConfig(**p["model"]), train=TrainConfig(**p["train"]))


def model_flags(p: dict) -> list[str]:
    """The preset's model and schedule as `spheroid train` / `spheroid node` flags."""
    flags = []
    for key, value in {**p["model"], **p["train"]}.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


def flops_per_step(cfg: RunConfig, part: int, data: torch.Tensor) -> float:
    """Mean FLOPs of FLOP_STEPS training steps of one part (a block, or REFERENCE_PART), torch's count."""
    module, loss_fn, _ = part_trainer(cfg, part, torch.device("cpu"))
    opt, gen = make_optimizer(module, cfg), torch.Generator().manual_seed(0)
    total = 0
    for _ in range(FLOP_STEPS):
        windows = random_windows(data, cfg.train.batch, cfg.model.context + 1, gen)
        total += costed_step(module, loss_fn, opt, windows, gen, cfg.train.grad_clip)[2].flops
    return total / FLOP_STEPS


def budgets(cfg: RunConfig, block_steps: int, data: torch.Tensor) -> dict:
    """Steps for every row so that each spends blocktrain's FLOPs: e2e all of them, diloco's N workers
    a share each."""
    n = cfg.model.n_blocks
    blocks = [flops_per_step(cfg, b, data) for b in range(n)]
    reference = flops_per_step(cfg, REFERENCE_PART, data)
    total = block_steps * sum(blocks)
    return {"block_flops_per_step": blocks, "reference_flops_per_step": reference, "target_flops": total,
            "block_steps": block_steps, "e2e_steps": round(total / reference),
            "diloco_steps": round(total / (n * reference))}


# --- the rows ------------------------------------------------------------------------------------


def run_e2e(p: dict, steps: int, work: Path, data: str | None) -> dict:
    """One worker, one thread, `spheroid train --reference`, with snapshots for the curve."""
    folder = work / "e2e"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    metrics = folder / "metrics.json"
    every = max(1, steps // 8)
    cmd = [sys.executable, "-m", "spheroid", "train", "--reference", "--out", str(folder), *model_flags(p),
           "--steps", str(steps), "--save-every", str(every), "--metrics", str(metrics), "--log-every", str(every)]
    if data:
        cmd += ["--data", str(data)]
    started = time.monotonic()
    with (folder / "train.log").open("w") as logf:
        proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise RuntimeError(f"e2e training failed; see {folder / 'train.log'}")
    wall = time.monotonic() - started
    m = json.loads(metrics.read_text())
    history = {json.loads(line)["step"]: json.loads(line) for line in
               (folder / "reference.history.jsonl").read_text().splitlines()}
    snaps = [{"step": int(d.name), "folder": str(d)} for d in sorted((folder / "steps").iterdir())]
    snaps.append({"step": steps, "folder": str(folder)})
    for s in snaps:
        s.update(bytes=0, flops=m["flops_per_step"] * s["step"], wall_s=history.get(s["step"], {}).get("wall_s"))
    worker = {"steps": steps, "train_flops": m["flops_per_step"] * steps, "peak_rss_mb": m["peak_rss_mb"],
              "memory_mb": m["memory"], "sent": 0}
    return {"name": "e2e", "transport": "local", "part": "reference", "snapshots": snaps, "wall_s": wall,
            "workers": {"e2e": worker}, "flags": cmd[4:]}


def run_nodes(name: str, parts: list[int], flags: list[str], p: dict, spec: LinkSpec, work: Path,
              data: str | None) -> dict:
    """A swarm of one node per entry of `parts` behind the links (bench/swarm.py's `run_swarm`)."""
    run_flags = [*model_flags(p), *flags, "--threads", "1"]
    run = run_swarm(work / name, run_flags, parts, spec, p["snapshot_s"], data)
    if bad := {n: c for n, c in run["exit_codes"].items() if c != 0}:
        raise RuntimeError(f"{name}: nodes did not stop cleanly: {bad}; logs in {work / name / 'nodes'}")
    workers = {n: {"steps": s["training"]["step"], "train_flops": s["training"]["train_flops"],
                   "peak_rss_mb": s["training"]["peak_rss_mb"], "memory_mb": s["training"]["memory_mb"],
                   "sent": s["swarm_traffic"]["sent"]["wire_bytes"], "block": s["training"]["block"]}
               for n, s in run["nodes"].items()}
    return {"name": name, "transport": "node", "part": "reference" if parts[0] == REFERENCE_PART else "blocks",
            "snapshots": run["snapshots"], "wall_s": run["wall_s"], "workers": workers, "flags": run_flags,
            "link_bytes": run["link_bytes"], "refresh_bytes": run["refresh_bytes"]}


def diloco_flags(every: int, outer_lr: float, codec: str, steps: int) -> list[str]:
    return ["--steps", str(steps), "--every", str(every), "--outer", "nesterov", "--outer-lr", str(outer_lr),
            "--outer-momentum", str(OUTER_MOMENTUM), "--codec", codec, "--error-feedback", "--lz4"]


def blocktrain_flags(steps: int) -> list[str]:
    """bench/swarm.py's best configuration at `steps` steps per block (its --steps-scale is what
    decides the budget there; here the budget is the FLOPs)."""
    best = list(CONFIGS["best"])
    i = best.index("--steps-scale")
    del best[i : i + 2]
    return [*best, "--steps", str(steps)]


def score(run: dict, windows: torch.Tensor) -> None:
    """Validation CE of every snapshot: the chain from pure noise at M = 1, or the reference."""
    for snap in run["snapshots"]:
        if run["part"] == "reference":
            snap["ce"] = evaluate_reference(snap["folder"], windows, torch.device("cpu"))
        else:
            chain, _ = evaluate_chain(snap["folder"], windows, draws=1, seed=0, device=torch.device("cpu"))
            snap["ce"] = chain.ce_one_draw
    run["ce"] = run["snapshots"][-1]["ce"]


class Runs:
    """The runs made so far, scored, kept in a file after each one: `--resume` makes only the runs
    missing there (an interrupted invocation loses at most the run it was in), and the results
    always come from the file."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        saved = json.loads(path.read_text()) if resume and path.exists() else {}
        self.runs: dict[str, dict] = saved.get("runs", {})
        self.provenance = saved.get("provenance") or provenance()
        if saved:
            self.provenance["resumed"] = provenance()

    def get(self, name: str, make: Callable[[], dict], windows: torch.Tensor) -> dict:
        """The run `name`: from the file, else made now, scored and saved."""
        if name not in self.runs:
            log.info("running %s", name)
            run = make()
            score(run, windows)
            self.runs[name] = run
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"runs": self.runs, "provenance": self.provenance}))
            log.info("%s: CE %.4f after %.2f MiB between workers", name, run["ce"],
                     run["snapshots"][-1]["bytes"] / 2**20)
        return self.runs[name]


def search_diloco(p: dict, n: int, steps: int, spec: LinkSpec, work: Path, data: str | None,
                  windows: torch.Tensor, runs: Runs) -> tuple[dict, list[dict]]:
    """Coordinate search over the preset's grid: each setting in turn, the others at their best so
    far. The best run (lowest final CE) and every run made."""
    grid = p["grid"]
    best = {key: values[0] for key, values in grid.items()}
    made: dict[str, dict] = {}

    def run(setting: dict) -> dict:
        name = "diloco-h{every}-lr{outer_lr}-{codec}".format(**setting)
        row = runs.get(name, lambda: {**run_nodes(name, [REFERENCE_PART] * n, diloco_flags(**setting, steps=steps),
                                                  p, spec, work, data), "setting": dict(setting)}, windows)
        made[name] = row
        return row

    for key, values in grid.items():
        tried = [run({**best, key: value}) for value in values]
        best = min(tried, key=lambda r: r["ce"])["setting"]
    return run(best), list(made.values())


# --- the results ---------------------------------------------------------------------------------


def row_summary(run: dict, name: str, cfg: RunConfig) -> dict:
    """A row of the results: the keys the README and docs read."""
    workers = run["workers"].values()
    snaps = run["snapshots"]
    trained = [sizing.parameters(cfg.model, "reference" if run["part"] == "reference" else w["block"])
               for w in workers]
    return {"name": name, "transport": run["transport"], "workers": len(run["workers"]), "ce": run["ce"],
            # the model a user ends with (the chain: every block; DiLoCo's replicas: one reference) and
            # what the largest worker trains
            "params": sum(trained) if run["part"] == "blocks" else trained[0], "params_max_worker": max(trained),
            "bytes_total": sum(w["sent"] for w in workers), "bytes_max_worker": max(w["sent"] for w in workers),
            "train_flops": sum(w["train_flops"] for w in workers),
            "train_flops_max_worker": max(w["train_flops"] for w in workers),
            "peak_rss_mb_max_worker": max(w["peak_rss_mb"] for w in workers),
            "train_memory_mb_max_worker": max(w["memory_mb"]["total"] for w in workers),
            "wall_s": run["wall_s"], "steps_per_worker": {k: w["steps"] for k, w in run["workers"].items()},
            "memory_mb": {k: w["memory_mb"] for k, w in run["workers"].items()},
            "curve": [[s["bytes"], s["ce"]] for s in snaps], "flops_curve": [[s["flops"], s["ce"]] for s in snaps],
            "wall_curve": [[s["wall_s"], s["ce"]] for s in snaps], "flags": without_data(run["flags"]),
            **({"setting": run["setting"]} if "setting" in run else {})}


def lz4_bits(run: dict, cfg: RunConfig, codec: str, steps: int, every: int) -> float | None:
    """Bits per value a refresh takes on the wire, measured: block 0's real change over `steps` steps
    (the change a reader fetches: between the first two snapshots whose block 0 lies steps / every
    rounds apart), in `codec` with lz4 as nodes send it; None for a run too short to have two (the
    model then takes the raw codec's bits). (int2's zeros, most of a typical change, compress: the
    raw codec's bits are a bound.)"""
    entries = [checkpoint.load(s["folder"], checkpoint.block_name(0)) for s in run["snapshots"]]
    gap = max(1, steps // every)
    pairs = [(a, b) for a in entries for b in entries if b.state["round"] - a.state["round"] == gap]
    if not pairs:
        return None
    a, b = pairs[0]
    first, second = (parameters_to_vector(block_from(e, cfg, torch.device("cpu"), 0).parameters()).detach()
                     for e in (a, b))
    change = second - first
    return 8 * len(encode_tensor(change, CODEC_OPTIONS[codec].name, "lz4")) / change.numel()


def without_data(flags: list[str]) -> list[str]:
    """Flags as recorded: the data folder (a path of the machine it ran on) left out."""
    out = list(flags)
    if "--data" in out:
        i = out.index("--data")
        del out[i : i + 2]
    return out


def check_projection(cfg: RunConfig, runs: dict[str, dict], rows: dict[str, dict], setting: dict) -> list[dict]:
    """spheroid/projection.py at the bench's shape beside the measured figures: the largest worker's
    training memory (weights, gradients, AdamW moments, what autograd kept for backward, frozen
    copies: what a node measures) and the busiest worker's bytes per optimizer step. The model
    counts the payload (updates, averages, refreshes); a node also sends pings, versions and peer
    lists, at a rate per second, not per step: the last block's node, which sends no payload,
    measures it, and the check sets the payload (sent less that rate times the run's wall time)
    beside the model."""
    best = CONFIGS["best"]
    blocks = runs["blocktrain"]
    last = max(blocks["workers"].values(), key=lambda w: w["block"])
    control = last["sent"] / blocks["wall_s"]  # bytes a second a node sends that carry no payload

    def flag(name: str) -> str:
        return best[best.index(name) + 1]

    checks = []
    for name, row in rows.items():
        if name == "e2e":
            model = projection.at_bench_shape(cfg, "e2e")
        elif name == "diloco":
            model = projection.at_bench_shape(cfg, "diloco", workers=row["workers"], every=setting["every"],
                                              codec=setting["codec"], outer="nesterov")
        else:
            every, refresh_every, refresh_codec = int(flag("--every")), int(flag("--refresh-every")), \
                flag("--refresh-codec")
            model = projection.at_bench_shape(cfg, "blocktrain", workers=1, every=every, codec=flag("--codec"),
                                              refresh_every=refresh_every, refresh_codec=refresh_codec,
                                              refresh_bits=lz4_bits(runs[name], cfg, refresh_codec, refresh_every,
                                                                    every))
        memory = max(sum(w["memory_mib"][k] for k in ("weights", "gradients", "optimizer", "frozen"))
                     + w["kept_for_backward_mib"] for w in model["workers"])
        steps = max(max(row["steps_per_worker"].values()), 1)
        sent = row["bytes_max_worker"] / steps
        payload = max(0.0, row["bytes_max_worker"] - control * row["wall_s"]) / steps if sent else 0.0
        bytes_model = model["bytes_per_step"]["busiest_worker"]
        checks.append({"name": name, "memory_mb_model": memory, "memory_mb_measured": row["train_memory_mb_max_worker"],
                       "memory_ratio": memory / row["train_memory_mb_max_worker"],
                       "bytes_per_step_model": bytes_model, "bytes_per_step_measured": sent,
                       "control_bytes_per_s": control, "payload_per_step_measured": payload,
                       "bytes_ratio": bytes_model / payload if payload else None})
    return checks


def plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_bytes, by_flops) = plt.subplots(1, 2, figsize=(11, 4))
    for name, row in rows.items():
        if row["bytes_total"]:
            by_bytes.plot([max(b, 1) / 2**20 for b, _ in row["curve"]], [c for _, c in row["curve"]], marker="o",
                          label=name)
        else:
            by_bytes.axhline(row["ce"], linestyle="--", color="grey", label=f"{name} (no bytes): final CE")
        by_flops.plot([f for f, _ in row["flops_curve"]], [c for _, c in row["flops_curve"]], marker="o", label=name)
    by_bytes.set_xscale("log")
    by_bytes.set_xlabel("bytes sent between workers (MiB, log)")
    by_flops.set_xlabel("training FLOPs, all workers")
    for ax in (by_bytes, by_flops):
        ax.set_ylabel("validation CE (nats/byte; chain M = 1)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_tables(result: dict) -> None:
    print(f"\n{'row':<11} {'transport':>9} {'workers':>7} {'CE':>7} {'MiB sent':>9} {'max/worker':>10} "
          f"{'FLOPs':>9} {'max/worker':>10} {'peak RSS':>8} {'train MiB':>9} {'wall s':>7}")
    for r in result["rows"]:
        print(f"{r['name']:<11} {r['transport']:>9} {r['workers']:>7} {r['ce']:>7.4f} "
              f"{r['bytes_total'] / 2**20:>9.2f} {r['bytes_max_worker'] / 2**20:>10.2f} {r['train_flops']:>9.2e} "
              f"{r['train_flops_max_worker']:>10.2e} {r['peak_rss_mb_max_worker']:>8.0f} "
              f"{r['train_memory_mb_max_worker']:>9.1f} {r['wall_s']:>7.0f}")
    c = result["config"]
    print(f"FLOPs spread across rows: {c['flops_spread']:.1%} (matched within {MATCH:.0%}: {c['flops_matched']})")
    print("\ndiloco grid (coordinate search; every run):")
    for g in result["grid"]:
        print(f"  H {g['every']:>4}  outer lr {g['outer_lr']:<4}  {g['codec']:<5} CE {g['ce']:.4f}  "
              f"{g['bytes_total'] / 2**20:8.2f} MiB")
    print("\nthe memory and traffic model (spheroid/projection.py) at this bench's shape, against the measurement "
          "(payload: sent less the pings, versions and peer lists a node sends a second, "
          f"{result['projection_check'][0]['control_bytes_per_s']:.0f} B/s):")
    print(f"  {'row':<11} {'memory MiB':>10} {'measured':>9} {'ratio':>6} {'B/step':>8} {'payload':>8} {'ratio':>6} "
          f"{'(all sent)':>10}")
    for ch in result["projection_check"]:
        ratio = f"{ch['bytes_ratio']:.2f}" if ch["bytes_ratio"] else "-"
        print(f"  {ch['name']:<11} {ch['memory_mb_model']:>10.2f} {ch['memory_mb_measured']:>9.2f} "
              f"{ch['memory_ratio']:>6.2f} {ch['bytes_per_step_model']:>8.0f} {ch['payload_per_step_measured']:>8.0f} "
              f"{ratio:>6} {ch['bytes_per_step_measured']:>10.0f}")
    print("\nlargest model whose largest worker trains on one 24 GiB GPU, by the model (one sequence a step, bf16):")
    for method, best in result["projection"]["largest_model"].items():
        print(f"  {method:<14} {best['shape']}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay of every link")
    parser.add_argument("--mbit", type=float, default=50.0, help="bandwidth of every link, per direction")
    parser.add_argument("--data", default=os.environ.get("SPHEROID_DATA"), help="WikiText folder")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (default runs/peers-<preset>/peers.json)")
    parser.add_argument("--work", type=Path, default=None,
                        help="node folders and snapshots (default runs/peers-<preset>)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs an earlier invocation left in --work (runs.json) and make only the rest")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    p = PRESETS[args.preset]
    work = args.work or Path("runs") / f"peers-{args.preset}"
    out = args.out or work / "peers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = LinkSpec(args.delay_ms, args.mbit)
    cfg = preset_config(p)
    n = cfg.model.n_blocks
    windows = fixed_windows(load_bytes(args.data, "valid"), p["windows"], cfg.model.context + 1)
    budget = budgets(cfg, p["block_steps"], load_bytes(args.data, "train"))
    log.info("budget: %.3e FLOPs a row; steps: blocktrain %d per block, e2e %d, diloco %d per worker",
             budget["target_flops"], budget["block_steps"], budget["e2e_steps"], budget["diloco_steps"])

    store = Runs(work / "runs.json", args.resume)
    runs = {"blocktrain": store.get("blocktrain", lambda: run_nodes(
        "blocktrain", list(range(n)), [*blocktrain_flags(p["block_steps"]), "--n-blocks", str(n)], p, spec, work,
        args.data), windows)}
    runs["diloco"], grid = search_diloco(p, n, budget["diloco_steps"], spec, work, args.data, windows, store)
    runs["e2e"] = store.get("e2e", lambda: run_e2e(p, budget["e2e_steps"], work, args.data), windows)

    rows = {name: row_summary(run, name, cfg) for name, run in runs.items()}
    flops = [r["train_flops"] for r in rows.values()]
    spread = max(flops) / min(flops) - 1
    setting = runs["diloco"]["setting"]
    result = {
        **store.provenance, "preset": args.preset,
        "link": {"delay_ms_one_way": spec.delay_ms, "mbit": spec.mbit},
        "config": {"run": cfg.to_dict(), "budget": budget, "flops_spread": spread, "flops_matched": spread <= MATCH,
                   "matched_by": "FLOPs per step counted by torch before the runs; e2e and diloco steps set so their "
                                 "total equals blocktrain's steps per block x the sum of the blocks' FLOPs per step",
                   "outer_momentum": OUTER_MOMENTUM, "diloco": setting, "eval_windows": p["windows"],
                   "threads_per_worker": 1},
        "rows": [rows[k] for k in ("e2e", "diloco", "blocktrain")],
        "grid": [{**g["setting"], "ce": g["ce"], "bytes_total": row_summary(g, g["name"], cfg)["bytes_total"],
                  "train_flops": row_summary(g, g["name"], cfg)["train_flops"], "wall_s": g["wall_s"]} for g in grid],
        "projection_check": check_projection(cfg, runs, rows, setting),
        "projection": projection.project(),
    }
    out.write_text(json.dumps(result, indent=2))
    plot(rows, out.with_suffix(".png"))
    print_tables(result)
    print(f"results: {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
