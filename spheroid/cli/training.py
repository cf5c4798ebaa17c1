"""The commands that train and evaluate models on this machine: train, eval, codebook."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import sys
import threading
from pathlib import Path

import click

from .. import checkpoint
from ..config import RunConfig, override
from ..data import fixed_windows, load_bytes
from ..loading import load_chain, load_reference, write_genesis_codebook
from ..pipeline import parse_blocks
from ..progress import duration
from ..resume import Interrupted, clear_run
from ..train import evaluate_bound, evaluate_chain, evaluate_reference, pick_device, train_block, train_reference
from .base import (
    POSITIVE,
    Failure,
    command,
    config_option,
    data_option,
    device_option,
    load_config,
    main,
    run_config_options,
)

log = logging.getLogger("spheroid")


@main.command()
@click.option("--block", "blocks", metavar="B|A-B|all", default=None,
              help="Train this block (0 = the highest noise band, the first of the chain), or these blocks in "
                   "order in one process (A-B, or all of them).")
@click.option("--reference", is_flag=True, help="Train the end-to-end reference instead of a block.")
@click.option("--out", type=click.Path(file_okay=False), default="checkpoints/local", show_default=True,
              help="Checkpoint folder; blocks trained into one folder form the assembled model. A rerun into it "
                   "resumes an interrupted run.")
@config_option("")
@run_config_options
@click.option("--save-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also snapshot the weights into OUT/steps/<step>/ every N steps (learning curves).")
@click.option("--resume-every", type=click.IntRange(min=0), default=200, show_default=True,
              help="Save the resumable state (weights, AdamW, RNGs, data position) every N steps; it is also "
                   "saved on Ctrl-C or SIGTERM and at the end.")
@click.option("--fresh", is_flag=True, help="Start over: ignore (and replace) a resumable state in OUT.")
@click.option("--log-every", type=POSITIVE, default=50, show_default=True, help="A progress line every N steps.")
@click.option("--metrics", type=click.Path(dir_okay=False), help="Write wall time, FLOPs and peak memory as JSON.")
@data_option
@device_option
@command
def train(blocks, reference, out, config_file, save_every, resume_every, fresh, log_every, metrics, data_dir, device,
          **overrides) -> None:
    """Train one block (--block B), several in order (--block A-B, --block all) or the end-to-end
    reference (--reference).

    Ctrl-C (or SIGTERM) saves a resumable state and exits with status 130; running the same command
    again continues from it (blocks already trained are said so and kept) and ends on the weights an
    uninterrupted run ends on."""
    if (blocks is None) == (not reference):
        raise click.UsageError("give exactly one of --block B or --reference")
    cfg = load_config(config_file, **overrides)
    if cfg.train.steps < 1:
        raise click.BadParameter("train needs at least one step", param_hint="--steps")
    jobs = {checkpoint.REFERENCE: None} if reference else {checkpoint.block_name(b): b for b in block_span(blocks, cfg)}
    several = not reference and (blocks == "all" or "-" in blocks)  # (--metrics then keys its results by block)
    if several and cfg.train.refresh_every:
        raise click.UsageError("--refresh-every trains every block at once, one process each: give one --block B "
                               "per process (or leave it out to train the range in order)")
    dev = pick_device(device)
    data = load_bytes(data_dir, "train")
    folder = Path(out)
    if fresh:
        for name in jobs:
            clear_run(folder, name)
    log.info("training on %d bytes of wiki.train.tokens, device %s", data.numel(), dev)
    stop = threading.Event()
    options = {"save_every": save_every, "log_every": log_every, "resume_every": resume_every, "stop": stop}
    results = {}
    with stop_on_signals(stop):
        for name, block in jobs.items():
            try:
                if reference:
                    result = train_reference(cfg, data, folder, dev, **options)
                else:
                    result = train_block(cfg, block, data, folder, dev, **options)
            except Interrupted as exc:
                again = "the same command again without --fresh" if fresh else "the same command again"
                click.echo(f"{exc}: run {again} to continue (--fresh to start over)", err=True)
                sys.exit(130)
            click.echo(f"{'' if len(jobs) == 1 else name + ': '}done in {duration(result.wall_s)}: loss "
                       f"{result.final_loss:.4f} ce {result.final_ce:.4f}; checkpoint in {out}")
            results[name] = {**vars(result), "config": cfg.to_dict()}
    if metrics:
        Path(metrics).write_text(json.dumps(results if several else results[name], indent=2))


def block_span(text: str, cfg: RunConfig) -> range:
    """The blocks `--block` names: B, A-B or all (of the model's), in training order."""
    if text == "all":
        return range(cfg.model.n_blocks)
    try:
        first, last = parse_blocks(text)
    except ValueError as exc:
        raise click.BadParameter(f"{exc} (or all)", param_hint="--block") from None
    if last >= cfg.model.n_blocks:
        raise click.BadParameter(f"the model has blocks 0-{cfg.model.n_blocks - 1}", param_hint="--block")
    return range(first, last + 1)


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event):
    """While inside, the first SIGINT or SIGTERM sets `stop` (the trainer saves and stops after its
    step); a second SIGINT interrupts at once."""
    def first(signum: int, _frame) -> None:
        log.warning("%s: stopping after this step (again to abort at once)", signal.Signals(signum).name)
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = {sig: signal.signal(sig, first) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def what_else(folder: Path) -> str:
    """What a folder without a model holds instead, and what to do with it (for an error message)."""
    if resumable := sorted(p.name.removesuffix(".resume.json") for p in folder.glob("*.resume.json")):
        return (f": only the resumable state of an unfinished run ({', '.join(resumable)}); run the same train "
                "command again to finish it")
    if workers := sorted({p.name.split(".")[0] for p in [*folder.glob("worker-*.json"),
                                                         *folder.glob("worker-*.safetensors")]}):
        return (f": only a swarm node's state ({', '.join(workers)}); with the swarm running, `spheroid assemble "
                "--peer HOST:PORT --out DIR` writes the model")
    return ""


@main.command(name="eval")
@click.argument("ckpt", type=click.Path(exists=True, file_okay=False))
@click.option("--split", type=click.Choice(["valid", "test"]), default="valid", show_default=True,
              help="Which WikiText split to score.")
@click.option("--variant", type=click.Choice(["tokens", "raw"]), default="tokens", show_default=True,
              help="wiki.*.tokens (<unk> for rare words) or wiki.*.raw.")
@click.option("--k", "chunk", type=POSITIVE, default=None,
              help="Chunk size of the attention mask.  [default: as trained]")
@click.option("--draws", type=POSITIVE, default=8, show_default=True, help="M: noise draws averaged.")
@click.option("--steps-per-block", type=POSITIVE, default=None, help="Euler steps per block.  [default: as trained]")
@click.option("--churn", type=click.FloatRange(min=0), default=None,
              help="Stochastic sampler: noise re-injected per step.  [default: as trained]")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the chain's starting noise.")
@click.option("--windows", type=POSITIVE, default=256, show_default=True, help="Evaluation windows, evenly spaced.")
@click.option("--bound", is_flag=True, help="Also the variational bound (VDM) of the blocks' diffusion model.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@data_option
@device_option
@command
def evaluate(ckpt, split, variant, chunk, draws, steps_per_block, churn, seed, windows, bound, as_json, data_dir,
             device) -> None:
    """CE of the chain in CKPT started from pure noise with a clean context (and of a reference there)."""
    dev = pick_device(device)
    results: dict[str, float | int | str] = {"split": f"wiki.{split}.{variant}", "draws": draws}
    have_blocks = bool(checkpoint.block_indices(ckpt))
    have_reference = (Path(ckpt) / f"{checkpoint.REFERENCE}.json").exists()
    if not (have_blocks or have_reference):
        raise Failure(f"{ckpt} holds neither blocks nor a reference checkpoint{what_else(Path(ckpt))}")
    if have_blocks and have_reference:  # (checked before the chain's minutes of work, not after)
        contexts = [checkpoint.read_config(ckpt, name).model.context
                    for name in (checkpoint.block_name(0), checkpoint.REFERENCE)]
        if contexts[0] != contexts[1]:
            raise Failure(f"{ckpt} holds a chain of context {contexts[0]} and a reference of context {contexts[1]}: "
                          "both are scored on the same windows; evaluate them from folders of their own")
    # each loaded once (its files verified once), and one at a time: the chain goes before the reference comes
    model = load_chain(ckpt, dev) if have_blocks else None
    reference = None if model else load_reference(ckpt, dev)
    context = (model or reference)[0].model.context
    win = fixed_windows(load_bytes(data_dir, split, variant), windows, context + 1)
    results["bytes"] = win.shape[0] * context
    if model:
        noise = override(model[0].noise, steps_per_block=steps_per_block, churn=churn)
        chain, alone = evaluate_chain(model, win, draws, seed, dev, chunk, noise)
        results.update(chain_ce_m1=chain.ce_one_draw, chain_ce=chain.ce_averaged, block0_alone_ce=alone)
        if bound:
            terms = evaluate_bound(model, win, seed, dev)
            results.update(bound_ce=terms.total, bound_prior=terms.prior, bound_diffusion=terms.diffusion,
                           bound_reconstruction=terms.reconstruction)
        model = None
    if have_reference:
        reference = reference or load_reference(ckpt, dev)
        results["reference_ce"] = evaluate_reference(reference[1], win, dev)
        results["reference_layers"] = reference[0].model.n_blocks * reference[0].model.layers_per_block
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    click.echo(f"{results['split']}: {results['bytes']} bytes scored")
    rows = [("chain_ce_m1", "chain from noise, M = 1"), ("chain_ce", f"chain from noise, M = {draws}"),
            ("block0_alone_ce", "block 0 alone at sigma_max"), ("bound_ce", "variational bound (VDM)"),
            ("reference_ce", f"reference, {results.get('reference_layers')} layer"
                             f"{'' if results.get('reference_layers') == 1 else 's'}")]
    for key, label in rows:
        if key in results:
            ce = float(results[key])
            bits, ppl = ce / math.log(2), math.exp(ce)
            click.echo(f"  {label:<30} CE {ce:.4f} nats/byte  {bits:.4f} bits/byte  PPL {ppl:.3f}")


@main.command()
@click.argument("reference", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Where to write the codebook.")
@command
def codebook(reference, out) -> None:
    """Make a genesis codebook from the byte embedding of a trained reference in REFERENCE."""
    digest = write_genesis_codebook(reference, out)
    click.echo(f"codebook written to {out}\nsha256 {digest}\n"
               f"train every block with: --codebook-file {out} --codebook-sha256 {digest}")
