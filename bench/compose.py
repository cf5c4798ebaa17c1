"""Compose benchmark: which configuration makes the chained blocks beat any one block alone?

The grid's base is method.md as written (noised inputs, EDM's skip path); every variant names what it
changes. Every variant trains its own blocks under the same budget (steps, batch, data, schedule) and is
scored the same way: the chain from pure noise with a clean context at M = 1 and M = 8 (and more
draws where a variant says so), and block 0 alone at sigma_max. The two end-to-end references of
bench/quality.py (full depth and one block deep) are trained in the same run. Variants that only
change inference (Euler steps per block, sampler, draws) reuse the blocks of the variant they
name instead of training again. Writes one JSON row per variant (--out; default
runs/compose-<preset>.json: the committed results were written with --out bench/results/...), with
the commit and command that made it, a PNG and a table.

    python bench/compose.py --preset ci|mini [--only NAME ...] [--out FILE] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from provenance import provenance

from spheroid.config import ModelConfig, NoiseConfig, RunConfig, TrainConfig, override
from spheroid.data import fixed_windows, load_bytes
from spheroid.loading import write_genesis_codebook
from spheroid.train import (
    evaluate_bound,
    evaluate_chain,
    evaluate_reference,
    pick_device,
    train_block,
    train_reference,
)

log = logging.getLogger("bench.compose")


@dataclass(frozen=True)
class Variant:
    """One point of the grid: overrides of the preset's config, or inference options on another's blocks."""

    name: str
    note: str
    model: dict = field(default_factory=dict)
    noise: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    reuse: str | None = None  # name of the variant whose trained blocks this one evaluates
    draws: int = 8
    method_change: bool = False  # True where the variant departs from method.md's training
    genesis: bool = False  # codebook from this run's reference byte embedding (a genesis file)


VARIANTS = [
    Variant("paper", "method.md as written: unit-norm codebook, sigma in [1, 10], (-1.2, 1.2)"),
    Variant("paper_m32", "paper's blocks, 32 draws averaged", reuse="paper", draws=32),
    Variant("paper_2steps", "paper's blocks, 2 Euler steps per block", noise={"steps_per_block": 2}, reuse="paper"),
    Variant("paper_churn", "paper's blocks, stochastic sampler (churn 0.5)", noise={"churn": 0.5}, reuse="paper"),
    Variant("norm2", "codebook rows of norm 2", model={"codebook_norm": 2.0}),
    Variant("norm4", "codebook rows of norm 4", model={"codebook_norm": 4.0}),
    Variant("lognormal_-0.4_1.0", "(P_mean, P_std) = (-0.4, 1.0)", noise={"p_mean": -0.4, "p_std": 1.0}),
    Variant("range_0.3_10", "sigma in [0.3, 10]", noise={"sigma_min": 0.3}),
    Variant("lr_2e-3", "peak learning rate 2e-3", train={"lr": 2e-3}),
    Variant("blocks_2x4", "2 blocks of 4 layers (same total depth)", model={"n_blocks": 2, "layers_per_block": 4}),
    Variant("blocks_8x1", "8 blocks of 1 layer (same total depth)", model={"n_blocks": 8, "layers_per_block": 1}),
    Variant("layout_merged", "merged layout: one token per byte holding x_i and z_i, causal (K = 1)",
            model={"layout": "merged"}),
    Variant("chain_input", "blocks trained on the chain's own states (frozen earlier blocks, forward only)",
            train={"block_input": "chain"}, method_change=True),
    Variant("chain_input_norm4", "chain-state training with codebook rows of norm 4",
            model={"codebook_norm": 4.0}, train={"block_input": "chain"}, method_change=True),
    Variant("chain_input_norm8", "chain-state training with codebook rows of norm 8",
            model={"codebook_norm": 8.0}, train={"block_input": "chain"}, method_change=True),
    Variant("paper_noskip", "method.md without EDM's skip path (D = c_out * F)", model={"edm_skip": False}),
    Variant("chain_input_noskip", "chain-state training without the skip path",
            model={"edm_skip": False}, train={"block_input": "chain"}, method_change=True),
    Variant("chain_input_norm4_noskip", "chain-state training, norm 4, without the skip path",
            model={"edm_skip": False, "codebook_norm": 4.0}, train={"block_input": "chain"}, method_change=True),
    Variant("chain_input_norm8_noskip", "chain-state training, norm 8, without the skip path",
            model={"edm_skip": False, "codebook_norm": 8.0}, train={"block_input": "chain"}, method_change=True),
    Variant("genesis", "genesis codebook: the reference's byte embedding, unit rows", genesis=True),
    Variant("chain_input_noskip_genesis", "the new default with a genesis codebook",
            model={"edm_skip": False}, train={"block_input": "chain"}, method_change=True, genesis=True),
    Variant("chain_input_merged", "chain-state training, merged layout",
            model={"layout": "merged"}, train={"block_input": "chain"}, method_change=True),
    Variant("chain_input_noskip_merged", "the new default with the merged layout",
            model={"edm_skip": False, "layout": "merged"}, train={"block_input": "chain"}, method_change=True),
    Variant("chain_input_norm4_merged", "chain-state training, norm 4, merged layout",
            model={"layout": "merged", "codebook_norm": 4.0}, train={"block_input": "chain"}, method_change=True),
    Variant("relay", "the default: chain states, no skip path, each block's clean stream relayed from the one before "
            "and trained by the relay loss",
            model={"edm_skip": False, "channel": "relay", "relay_loss": 1.0}, train={"block_input": "chain"},
            method_change=True),
    Variant("relay_untrained", "relay channel without the relay loss (what is relayed is trained only through the "
            "weights it shares with the noisy stream)",
            model={"edm_skip": False, "channel": "relay", "relay_loss": 0.0}, train={"block_input": "chain"},
            method_change=True),
    Variant("relay_noised", "relay channel on noised inputs (no skip path): depth without chain states",
            model={"edm_skip": False, "channel": "relay", "relay_loss": 1.0}, method_change=True),
]

PRESETS: dict[str, dict] = {
    # for the test suite: two variants of a model that trains in seconds
    "ci": {"model": {"d_model": 32, "n_heads": 2, "layers_per_block": 1, "context": 32},
           "train": {"steps": 30, "batch": 8, "warmup": 5}, "eval_windows": 16,
           "variants": ["paper", "paper_2steps", "chain_input", "genesis", "relay"]},
    # the grid on a 2-core CPU: about a minute per trained variant
    "mini": {"model": {"d_model": 64, "n_heads": 4, "layers_per_block": 2, "context": 64},
             "train": {"steps": 400, "batch": 32, "warmup": 40}, "eval_windows": 128,
             "variants": [v.name for v in VARIANTS]},
}


# the grid's base is method.md as written (z is all that passes between blocks); spheroid's defaults
# are the variant relay
PAPER = {"model": {"edm_skip": True, "channel": "z"}, "train": {"block_input": "noised"}}


def variant_config(base: RunConfig, v: Variant) -> RunConfig:
    return RunConfig(model=override(base.model, **v.model), noise=override(base.noise, **v.noise),
                     train=override(base.train, **v.train))


def run(preset: str, names: list[str], work: Path, data: str | None, device: torch.device) -> dict:
    p = PRESETS[preset]
    base = RunConfig(model=ModelConfig(**p["model"], **PAPER["model"]), noise=NoiseConfig(),
                     train=TrainConfig(**p["train"], **PAPER["train"]))
    train_data = load_bytes(data, "train")
    windows = fixed_windows(load_bytes(data, "valid"), p["eval_windows"], base.model.context + 1)
    by_name = {v.name: v for v in VARIANTS}
    rows, started = [], time.monotonic()

    refs = {}
    for label, n_blocks in (("reference", base.model.n_blocks), ("single_block_reference", 1)):
        cfg = RunConfig(model=override(base.model, n_blocks=n_blocks), noise=base.noise, train=base.train)
        fit = train_reference(cfg, train_data, work / label, device)
        refs[label] = {"ce": evaluate_reference(work / label, windows, device), "wall_s": fit.wall_s}
        log.info("%s: CE %.4f (%.0fs)", label, refs[label]["ce"], fit.wall_s)

    for name in names:
        v = by_name[name]
        cfg = variant_config(base, v)
        if v.genesis:
            digest = write_genesis_codebook(work / "reference", work / "genesis-codebook.safetensors")
            cfg = RunConfig(model=override(cfg.model, codebook_file=str(work / "genesis-codebook.safetensors"),
                                           codebook_sha256=digest), noise=cfg.noise, train=cfg.train)
        folder = work / (v.reuse or v.name)
        wall = 0.0
        if v.reuse is None:
            for b in range(cfg.model.n_blocks):
                wall += train_block(cfg, b, train_data, folder, device).wall_s
        t0 = time.monotonic()
        chain, alone = evaluate_chain(folder, windows, v.draws, 0, device, noise=cfg.noise)
        bound = evaluate_bound(folder, windows, 0, device)
        row = {
            "variant": v.name, "note": v.note, "method_change": v.method_change, "reuses": v.reuse,
            "blocktrain_ce_m1": chain.ce_one_draw, f"blocktrain_ce_m{v.draws}": chain.ce_averaged,
            "blocktrain_ce": chain.ce_averaged, "draws": v.draws, "block0_alone_ce": alone,
            "bound_ce": bound.total, "bound_terms": vars(bound),
            "train_wall_s": wall, "eval_wall_s": time.monotonic() - t0,
            "vs_single_block_reference": chain.ce_averaged - refs["single_block_reference"]["ce"],
            "vs_block0_alone": chain.ce_averaged - alone,
            "gap": chain.ce_averaged - refs["reference"]["ce"],
            "config": cfg.to_dict(),
        }
        rows.append(row)
        log.info("%s: chain M=1 %.4f, M=%d %.4f, block 0 alone %.4f", v.name, chain.ce_one_draw, v.draws,
                 chain.ce_averaged, alone)
    return {"preset": preset, "references": refs, "variants": rows, "eval_windows": p["eval_windows"],
            "eval_bytes": p["eval_windows"] * base.model.context, "base_config": base.to_dict(),
            "device": str(device), "torch": torch.__version__, "total_s": time.monotonic() - started}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["variants"]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 2))
    y = list(range(len(rows)))
    ax.barh(y, [r["blocktrain_ce"] for r in rows], color="tab:blue", alpha=0.7, label="chain, M draws averaged")
    ax.scatter([r["blocktrain_ce_m1"] for r in rows], y, color="tab:red", zorder=3, label="chain, M = 1")
    ax.scatter([r["block0_alone_ce"] for r in rows], y, color="black", marker="|", s=200, zorder=3,
               label="block 0 alone")
    for key, style in (("reference", "--"), ("single_block_reference", ":")):
        ax.axvline(result["references"][key]["ce"], color="gray", linestyle=style, label=key.replace("_", " "))
    ax.set_yticks(y, [r["variant"] for r in rows])
    ax.invert_yaxis()
    ces = [r[k] for r in rows for k in ("blocktrain_ce", "blocktrain_ce_m1", "block0_alone_ce")]
    ax.set_xlim(min(ces + [result["references"]["reference"]["ce"]]) - 0.1, min(max(ces), 6.0) + 0.1)
    ax.set_xlabel("validation CE, nats/byte (wiki.valid.tokens)")
    ax.set_title(f"compose, preset {result['preset']}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(result: dict) -> None:
    refs = result["references"]
    print(f"\nreference (full depth) CE {refs['reference']['ce']:.4f}; "
          f"one-block-deep reference CE {refs['single_block_reference']['ce']:.4f}")
    print(f"{'variant':<26} {'M=1':>7} {'M avg':>7} {'M':>3} {'block0':>7} {'bound':>7} {'vs 1blk':>8} {'vs b0':>7} "
          f"{'train s':>8}")
    for r in result["variants"]:
        print(f"{r['variant']:<26} {r['blocktrain_ce_m1']:>7.4f} {r['blocktrain_ce']:>7.4f} {r['draws']:>3} "
              f"{r['block0_alone_ce']:>7.4f} {r['bound_ce']:>7.3f} {r['vs_single_block_reference']:>+8.4f} "
              f"{r['vs_block0_alone']:>+7.4f} {r['train_wall_s']:>8.1f}"
              f"{'  (method change)' if r['method_change'] else ''}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="ci")
    parser.add_argument("--only", nargs="+", help="variant names to run (default: the preset's list)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON (default runs/compose-<preset>.json; pass bench/results/... to commit one)")
    parser.add_argument("--work", type=Path, default=None, help="checkpoints (default runs/compose-<preset>)")
    parser.add_argument("--data", default=os.environ.get("SPHEROID_DATA"))
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    names = args.only or PRESETS[args.preset]["variants"]
    unknown = set(names) - {v.name for v in VARIANTS}
    if unknown:
        parser.error(f"unknown variant(s) {sorted(unknown)}; known: {[v.name for v in VARIANTS]}")
    out = args.out or Path("runs") / f"compose-{args.preset}.json"
    work = args.work or Path("runs") / f"compose-{args.preset}"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {**provenance(), **run(args.preset, names, work, args.data, pick_device(args.device))}
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print_table(result)
    print(f"\nJSON: {out}\nplot: {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
