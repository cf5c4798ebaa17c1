"""The `spheroid` command line: a thin layer of click commands over the library."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import functools
import json
import logging
import math
import re
import signal
import sys
import threading
import tomllib
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click
import torch

from . import checkpoint
from .averaging import CODECS, OUTER_STEPS, AveragingConfig
from .chain import DEFAULT_DRAFT, generate_reference
from .chain import generate as run_chain
from .config import (
    REFERENCE_PART,
    REFRESH_CODECS,
    ModelConfig,
    NodeConfig,
    NoiseConfig,
    RunConfig,
    TrainConfig,
    override,
    parse_addr,
    part_name,
)
from .data import DataError, fixed_windows, load_bytes
from .launch import LocalSwarm
from .node.client import assemble_swarm, fetch_status, remote_generate, score_text
from .node.connection import PeerGone
from .node.identity import IdentityError
from .node.identity import load_or_create as load_identity
from .node.node import Node, tune_allocator
from .node.serving import BlockServer, ReferenceServer
from .node.worker import BlockWorker
from .pipeline import parse_blocks
from .progress import OneLineFormatter, Progress, duration
from .loading import load_chain, load_reference, write_genesis_codebook
from .resume import Interrupted, clear_run
from .train import evaluate_bound, evaluate_chain, evaluate_reference, pick_device, train_block, train_reference
from .wire import ProtocolError

log = logging.getLogger("spheroid")


class Failure(click.ClickException):
    """An error with a message for the user: printed without a traceback, exit code 1."""


# errors the library raises for bad input (a file, a flag's value, a peer): one line, no traceback
EXPECTED = (DataError, checkpoint.CheckpointError, IdentityError, ValueError, FloatingPointError, OSError)


def setup_logging(verbose: int, quiet: bool, log_file: str | None) -> None:
    """Log to stderr (and to --log-file): INFO by default, -v DEBUG for spheroid, -vv for everything."""
    level = logging.WARNING if quiet else (logging.DEBUG if verbose else logging.INFO)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        try:
            handlers.append(logging.FileHandler(log_file))
        except OSError as exc:
            raise click.BadParameter(f"cannot open {log_file}: {exc.strerror or exc}", param_hint="--log-file") from exc
    for handler in handlers:
        handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level if verbose > 1 else min(level, logging.INFO), handlers=handlers, force=True)
    logging.getLogger("spheroid").setLevel(level)
    logging.getLogger().setLevel(level if verbose > 1 else max(level, logging.INFO))


def command(func):
    """A subcommand: the options every command takes (-v, -q, --log-file, --debug), logging set up
    from them (and the group's), and the library's expected errors as one clear line, exit 1 (with
    --debug, the traceback)."""

    @functools.wraps(func)
    def wrapper(*args, verbose: int, quiet: bool, log_file: str | None, debug: bool, **kwargs):
        root = click.get_current_context().find_root().params
        setup_logging(verbose + root.get("verbose", 0), quiet or root.get("quiet", False),
                      log_file or root.get("log_file"))
        debug = debug or root.get("debug", False)
        try:
            return func(*args, **kwargs)
        except click.ClickException:
            raise
        except EXPECTED as exc:
            if debug:
                raise
            raise Failure(str(exc)) from exc
        except RuntimeError as exc:  # (torch's allocators say so in a RuntimeError)
            if debug or not (isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)):
                raise
            wanted = re.search(r"allocate (\d+) bytes", str(exc))
            size = f" ({int(wanted.group(1)) / 2**30:.1f} GiB at once)" if wanted else ""
            raise Failure(f"not enough memory{size}: lower --batch or --windows, or the model's size") from exc

    for option in reversed(COMMON_OPTIONS):
        wrapper = option(wrapper)
    return wrapper


COMMON_OPTIONS = [
    click.option("-v", "--verbose", count=True, help="More log output (-vv: also the libraries')."),
    click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors."),
    click.option("--log-file", type=click.Path(dir_okay=False), help="Also write the log to this file."),
    click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors."),
]


class Spheroid(click.Group):
    """The command group, with usage errors as one line (and exit status 2) instead of click's three."""

    def main(self, *args, **kwargs):
        kwargs.pop("standalone_mode", None)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as exc:
            where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
            click.echo(f"Error: {exc.format_message()}{where}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted.", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=Spheroid)
@click.version_option(package_name="spheroid", prog_name="spheroid")
@click.option("-v", "--verbose", count=True, help="More log output (-vv: also the libraries').")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors.")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Also write the log to this file.")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
def main(verbose: int, quiet: bool, log_file: str | None, debug: bool) -> None:
    """spheroid: decentralised training and serving of BlockTrain byte-level language models.

    Every subcommand takes -v, -q, --log-file and --debug too; `spheroid COMMAND --help` for its flags."""


def check_device(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refuse a device this torch build cannot use, before any work starts."""
    if value is None:
        return None
    try:
        dev = torch.device(value)
    except RuntimeError as exc:
        raise click.BadParameter(f"{value!r} is not a torch device (cpu, cuda, cuda:1, mps)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter(f"this torch build ({torch.__version__}) sees no CUDA device: use --device cpu, "
                                 f"or install a CUDA build (make TORCH=... PIP_TORCH_FLAGS=...)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise click.BadParameter("MPS is not available here: use --device cpu")
    return value


data_option = click.option(
    "--data", "data_dir", envvar="SPHEROID_DATA", type=click.Path(), default=None,
    help="WikiText folder (wiki.{train,valid,test}.{tokens,raw}, plain or .xz); default $SPHEROID_DATA.",
)
device_option = click.option("--device", default=None, callback=check_device,
                             help="torch device  [default: cuda when present, else cpu]")
POSITIVE = click.IntRange(min=1)


def finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def host_port(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A node's address, HOST:PORT, checked before anything is dialled."""
    try:
        if value is not None:
            parse_addr(value)
        return value
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def chunk_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    """'1,4,16' -> (1, 4, 16)."""
    if value is None:
        return None
    try:
        chunks = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a list of chunk sizes such as 1,4,16") from None
    if any(k < 1 for k in chunks):
        raise click.BadParameter(f"{value!r}: chunk sizes are at least 1")
    return chunks


def read_config_file(path: str) -> dict:
    """A configuration file as a dict: JSON or TOML (by extension). A checkpoint's JSON record (as
    written beside every checkpoint) stands for the run configuration it holds."""
    text = Path(path).read_text()
    try:
        data = tomllib.loads(text) if path.endswith(".toml") else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise click.BadParameter(f"{path} is not valid {'TOML' if path.endswith('.toml') else 'JSON'}: {exc}",
                                 param_hint="--config") from exc
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path} must hold an object", param_hint="--config")
    if data.get("format") == checkpoint.FORMAT and isinstance(data.get("config"), dict):
        return data["config"]
    return data


COMMAND_TABLES = ("node",)  # commands whose flags a config file may hold, in a table of the command's name


def config_file_defaults(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--config: the file's [node] (or [swarm], ...) table becomes the defaults of this command's
    flags, so one file can hold a node's whole setup; flags on the command line still win."""
    if value is None or ctx.info_name not in COMMAND_TABLES:
        return value
    table = read_config_file(value).get(ctx.info_name, {})
    if not isinstance(table, dict):
        raise click.BadParameter(f"{value}: [{ctx.info_name}] must be a table of flags", param_hint="--config")
    params = {}  # a flag as the table may spell it (`peer`, `max-peers`, `checkpoint`) -> its parameter
    for p in ctx.command.params:
        for spelling in [p.name, *(o.lstrip("-").replace("-", "_") for o in getattr(p, "opts", []))]:
            params[spelling] = p
    unknown = sorted(k for k in table if k.replace("-", "_") not in params)
    if unknown:
        raise click.BadParameter(f"{value}: [{ctx.info_name}] has no flag(s) {unknown}", param_hint="--config")
    flags = {}
    for key, given in table.items():
        p = params[key.replace("-", "_")]
        flags[p.name] = [given] if getattr(p, "multiple", False) and not isinstance(given, list) else given
    ctx.default_map = {**(ctx.default_map or {}), **flags}
    return value


def config_option(what: str):
    return click.option(
        "--config", "config_file", type=click.Path(exists=True, dir_okay=False), is_eager=True,
        callback=config_file_defaults,
        help=f"A JSON or TOML file: model/noise/train tables (a RunConfig, or a checkpoint's JSON record){what}; "
             "flags override it.")


def load_config(config_file: str | None, **model_noise_train) -> RunConfig:
    """The run configuration: a file (or the defaults) with command-line overrides on top."""
    if config_file:
        data = read_config_file(config_file)
        run = {k: v for k, v in data.items() if k in ("model", "noise", "train")}
        unknown = sorted(set(data) - {"model", "noise", "train", *COMMAND_TABLES})
        if unknown:
            raise click.BadParameter(f"{config_file}: unknown table(s) {unknown}; a run configuration has model, "
                                     f"noise and train, and flags of a command go under its name (node, ...)",
                                     param_hint="--config")
        try:
            cfg = RunConfig.from_dict(run)
        except ValueError as exc:
            raise click.BadParameter(f"{config_file}: {exc}", param_hint="--config") from exc
    else:
        cfg = RunConfig()
    groups = {"model": {}, "noise": {}, "train": {}}
    for key, value in model_noise_train.items():
        group, field = key.split("__")
        groups[group][field] = value
    try:
        return RunConfig(
            model=override(cfg.model, **groups["model"]),
            noise=override(cfg.noise, **groups["noise"]),
            train=override(cfg.train, **groups["train"]),
        )
    except ValueError as exc:  # values that do not go together, such as --n-heads that does not divide --d-model
        raise click.UsageError(f"{exc}") from exc


def default(group: type, name: str) -> str:
    """`[default: X]` from a configuration dataclass, for help texts."""
    return f"[default: {next(f.default for f in dataclasses.fields(group) if f.name == name)}]"


def run_config_options(func):
    """The model, noise and training flags shared by `train` and `node` (they override --config)."""
    m, n, t = ModelConfig, NoiseConfig, TrainConfig
    options = [
        click.option("--steps", "train__steps", type=click.IntRange(min=0),
                     help=f"Optimizer steps (per block). {default(t, 'steps')}"),
        click.option("--batch", "train__batch", type=POSITIVE, help=f"Windows per step. {default(t, 'batch')}"),
        click.option("--lr", "train__lr", type=float, help=f"Peak learning rate (AdamW). {default(t, 'lr')}"),
        click.option("--warmup", "train__warmup", type=click.IntRange(min=0),
                     help=f"Steps of linear learning-rate warm-up. {default(t, 'warmup')}"),
        click.option("--seed", "train__seed", type=int,
                     help=f"Seed of the initial weights, the batches and the noise. {default(t, 'seed')}"),
        click.option("--d-model", "model__d_model", type=POSITIVE, help=f"Model width. {default(m, 'd_model')}"),
        click.option("--n-heads", "model__n_heads", type=POSITIVE,
                     help=f"Attention heads (must divide --d-model). {default(m, 'n_heads')}"),
        click.option("--layers-per-block", "model__layers_per_block", type=POSITIVE,
                     help=f"Transformer layers of each block. {default(m, 'layers_per_block')}"),
        click.option("--n-blocks", "model__n_blocks", type=POSITIVE,
                     help=f"Blocks of the model; an end-to-end reference is n_blocks x layers_per_block deep. "
                          f"{default(m, 'n_blocks')}"),
        click.option("--context", "model__context", type=click.IntRange(min=2),
                     help=f"Bytes of context a block reads. {default(m, 'context')}"),
        click.option("--chunk", "model__chunk", type=POSITIVE,
                     help=f"K: the chunk of the attention mask blocks train with (1 = next byte; K > 1 for sweeps). "
                          f"{default(m, 'chunk')}"),
        click.option("--codebook-seed", "model__codebook_seed", type=int,
                     help=f"Seed of the fixed target codebook. {default(m, 'codebook_seed')}"),
        click.option("--codebook-norm", "model__codebook_norm", type=float,
                     help=f"Row norm of the codebook. {default(m, 'codebook_norm')}"),
        click.option("--codebook-file", "model__codebook_file", help="Genesis codebook (from `spheroid codebook`)."),
        click.option("--codebook-sha256", "model__codebook_sha256", help="sha256 the genesis codebook file must have."),
        click.option("--edm-skip/--no-edm-skip", "model__edm_skip", default=None,
                     help="EDM's skip path c_skip * z in the denoiser (method.md has it).  [default: without]"),
        click.option("--layout", "model__layout", type=click.Choice(["concat", "merged"]),
                     help="Block token layout: concat ([clean | noisy], any K) or merged (one token per byte, K = 1 "
                          "only: half the activation memory, no relay, sweeps or serving).  [default: concat]"),
        click.option("--channel", "model__channel", type=click.Choice(["relay", "z"]),
                     help="What a block reads of the blocks before it besides z: relay (its clean stream starts "
                          "from the previous block's, so the stack computes its full depth on the context) or z "
                          "only (method.md).  [default: relay]"),
        click.option("--relay-loss", "model__relay_loss", type=float,
                     help="With --channel relay, the weight of a next-byte loss on each relayed clean stream, "
                          f"so that what a block hands on is trained. {default(m, 'relay_loss')}"),
        click.option("--gate-init", "model__gate_init", type=float,
                     help="Where the blocks' AdaLN gates start: 0 is AdaLN-Zero (each layer starts as the "
                          f"identity), 1 a plain layer's residual branches. {default(m, 'gate_init')}"),
        click.option("--reference-layout", "model__reference_layout", type=click.Choice(["plain", "two_stream"]),
                     help="The end-to-end reference's layout (train --reference): a plain causal transformer, or "
                          "the blocks' two streams (a clean stream, and a query token per position reading it).  "
                          "[default: plain]"),
        click.option("--p-mean", "noise__p_mean", type=float,
                     help=f"Mean of log sigma's training distribution. {default(n, 'p_mean')}"),
        click.option("--p-std", "noise__p_std", type=float,
                     help=f"Standard deviation of log sigma. {default(n, 'p_std')}"),
        click.option("--sigma-min", "noise__sigma_min", type=float,
                     help=f"Lowest noise level. {default(n, 'sigma_min')}"),
        click.option("--sigma-max", "noise__sigma_max", type=float,
                     help=f"Highest noise level (the chain starts there). {default(n, 'sigma_max')}"),
        click.option("--block-input", "train__block_input", type=click.Choice(["noised", "chain"]),
                     help="What a block learns to denoise: noised (e(y) + sigma eps, method.md) or chain (the "
                          "states the earlier, frozen blocks' chain reaches).  [default: chain]"),
        click.option("--chunks", "train__chunks", callback=chunk_list, metavar="K,K,...",
                     help="Train under a mix of chunk sizes, one K drawn per batch (e.g. 1,4,16), so one checkpoint "
                          "serves ar, sweeps and drafts.  [default: the model's --chunk only]"),
        click.option("--refresh-every", "train__refresh_every", type=click.IntRange(min=0),
                     help="Train all blocks at once: publish this block into --out and reload the earlier blocks' "
                          "newest snapshots every R steps (their genesis states until they appear); 0 = the "
                          "earlier blocks are trained first.  [default: 0; `node`: fetch them from their holders "
                          "every R steps, default 100]"),
        click.option("--refresh-codec", "train__refresh_codec", type=click.Choice(REFRESH_CODECS),
                     help="How a swarm node refreshes the earlier blocks it reads: fp32, verified snapshots; "
                          "fp16, bf16, int8, int4 or int2, the change from the copy it holds, in that codec (fewer "
                          "bytes; the copy is close, not exact, and what rounding lost goes with the next "
                          "change; a first change from a state more than a round old comes in int8).  [default: fp32]"),
    ]
    for option in reversed(options):
        func = option(func)
    return func


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


def tls_options(func):
    """--tls-cert, --tls-key, --tls-ca: TLS on every connection, mutual with a CA."""
    for name, text in (("--tls-ca", "CA certificate: verify peers against it (mutual TLS)."),
                       ("--tls-key", "TLS private key (PEM)."), ("--tls-cert", "TLS certificate (PEM).")):
        func = click.option(name, type=click.Path(exists=True, dir_okay=False), help=text)(func)
    return func


def client_options(func):
    """How a client reaches a swarm: its id, its secret, TLS (as the nodes of that swarm were started)."""
    options = [
        click.option("--swarm", default="spheroid", show_default=True, help="Swarm id the node belongs to."),
        click.option("--secret-file", type=click.Path(exists=True, dir_okay=False),
                     help="The swarm secret, when its nodes were started with one."),
        click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Seconds to wait for an answer (generate and score: for their next message, so a long "
                          "generation goes on while bytes come).  [default: 10 for status and assemble, 300 for "
                          "generate, 600 for score]"),
    ]
    for option in reversed(options):
        func = option(func)
    return tls_options(func)


def client_config(swarm: str, timeout: float, tls_cert: str | None, tls_key: str | None,
                  tls_ca: str | None) -> NodeConfig:
    """A client's NodeConfig: waits for one reply at most 30 s (a long request keeps pinging)."""
    try:
        return NodeConfig(swarm=swarm, role="client", timeout=min(timeout, 30.0), tls_cert=tls_cert, tls_key=tls_key,
                          tls_ca=tls_ca)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


# control characters but newline and tab, shown as \xNN: bytes from a remote node must not drive the
# user's terminal (escape sequences)
CONTROLS = {c: "".join(f"\\x{b:02x}" for b in chr(c).encode()) for c in [*range(32), *range(0x7F, 0xA0)]
            if c not in (9, 10)}


class ByteWriter:
    """Writes a model's bytes to stdout as they come: unchanged with `raw`, else as UTF-8 text with
    every byte that is not part of valid UTF-8, and every control character but newline and tab,
    shown visibly as \\xNN (nothing is dropped)."""

    def __init__(self, raw: bool) -> None:
        self.raw = raw
        self.stream = sys.stdout.buffer
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")

    def write(self, data: bytes, final: bool = False) -> None:
        self.stream.write(data if self.raw else self.decoder.decode(data, final).translate(CONTROLS).encode())
        self.stream.flush()


@main.command()
@click.argument("target", required=False)
@click.option("--peer", callback=host_port, default=None,
              help="Generate through the pipeline this serving node coordinates; TARGET is then the prompt.")
@click.option("--prompt", default="", help="Text to continue (locally; with --peer give it as TARGET).")
@click.option("--bytes", "n_bytes", type=click.IntRange(1, 1 << 16), default=200, show_default=True,
              help="How many bytes to generate.")
@click.option("--mode", type=click.Choice(["sweep", "ar", "spec"]), default="sweep", show_default=True,
              help="sweep (K bytes per traversal), ar (one byte per traversal) or spec (speculative: drafted "
                   "bytes checked with the next one; exactly ar's output in fewer traversals).")
@click.option("--k", "chunk", type=POSITIVE, default=None,
              help="Bytes denoised per traversal; with --mode spec, the most drafted bytes one checks.  [default: "
                   f"1; with --peer --mode sweep, as many as the window holds; with --mode spec, {DEFAULT_DRAFT}]")
@click.option("--route", default="auto", show_default=True,
              help="With --peer: auto (from membership, lowest RTT) or node ids (or prefixes) A,B,C in order.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.8, show_default=True, callback=finite,
              help="0 = the most likely byte.")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True,
              help="Seed of the noise and the sampling.")
@click.option("--raw", is_flag=True, help="Write the model's bytes to stdout unchanged (by default bytes that are "
                                         "not UTF-8 are shown as \\xNN).")
@client_options
@device_option
@command
def generate(target, peer, prompt, n_bytes, mode, chunk, route, temperature, seed, raw, swarm, secret_file, timeout,
             tls_cert, tls_key, tls_ca, device) -> None:
    """Generate bytes: `generate CKPT --prompt TEXT` locally, or `generate --peer HOST:PORT TEXT` in a swarm."""
    out = ByteWriter(raw)
    if peer is None:
        if target is None or not Path(target).is_dir():
            raise click.UsageError("give a checkpoint folder (or --peer HOST:PORT to use a swarm)")
        dev = pick_device(device)
        text, stats = as_bytes(prompt), {}
        if not checkpoint.block_indices(target) and (Path(target) / f"{checkpoint.REFERENCE}.json").exists():
            log.info("%s holds the end-to-end reference: it generates one byte per forward pass (mode ar)", target)
            _, reference = load_reference(target, dev)
            out.write(text + generate_reference(reference, text, n_bytes, temperature, seed) + b"\n", final=True)
            return
        cfg, blocks, codebook = load_chain(target, dev)
        draft = (chunk or DEFAULT_DRAFT) if mode == "spec" else 0
        k = 1 if draft or mode == "ar" else chunk or 1
        out.write(text + run_chain(blocks, cfg.noise, codebook, text, n_bytes, k, temperature, seed, draft, stats)
                  + b"\n", final=True)
        log.info("%d bytes in %d traversals", n_bytes, stats["traversals"])
        return
    if target and Path(target).is_dir() and checkpoint.block_indices(target):
        raise click.UsageError(f"{target} is a checkpoint folder, but --peer generates through the swarm: give the "
                               f"prompt as TARGET (or drop --peer to generate from {target} here)")
    text = as_bytes(target if target is not None else prompt)
    k = 1 if mode == "ar" else (chunk or 0)  # 0: the coordinator's default (sweep: as many as the window holds)
    cfg = client_config(swarm, timeout or 300.0, tls_cert, tls_key, tls_ca)
    out.write(text)

    async def ask() -> dict:
        hops = await resolve_route(peer, cfg, route, read_secret(secret_file))
        request = {"prompt": text, "n_bytes": n_bytes, "mode": mode, "k": k, "temperature": temperature,
                   "seed": seed, "route": hops}
        return await remote_generate(peer, cfg, request, on_bytes=out.write, timeout=timeout or 300.0,
                                     secret=read_secret(secret_file))

    try:
        result = run_client(ask, f"request to {peer} failed")
    finally:
        out.write(b"\n", final=True)  # (the prompt is out already: an error starts on a line of its own)
    log.info("%d bytes in %d traversals via %s", result["bytes"], result["traversals"],
             " -> ".join(h[0][:8] for h in result["route"]))


def as_bytes(text: str) -> bytes:
    """A command-line string as the bytes the user typed (bytes that are not UTF-8 included)."""
    return text.encode("utf-8", errors="surrogateescape")


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--peer", callback=host_port, required=True, help="A serving node: it coordinates the request.")
@click.option("--k", "chunk", type=POSITIVE, default=1, show_default=True, help="Chunk size of the attention mask.")
@click.option("--route", default="auto", show_default=True, help="auto, or node ids (or prefixes) A,B,C.")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True,
              help="Seed of the chain's starting noise.")
@client_options
@command
def score(file, peer, chunk, route, seed, swarm, secret_file, timeout, tls_cert, tls_key, tls_ca) -> None:
    """CE of FILE through the swarm's pipeline: one traversal per window, one draw (M = 1).

    The text is cut into windows of the model's context + 1 bytes, each overlapping the next by one
    byte; a tail too short for a window is not scored (the report says how many bytes that was).
    A text of any length is sent as requests of 64 KiB, a few at once, with the same windows and
    noise as one request would have (progress is logged as they come back)."""
    text = Path(file).read_bytes()
    cfg = client_config(swarm, timeout or 600.0, tls_cert, tls_key, tls_ca)

    async def ask() -> dict:
        secret = read_secret(secret_file)
        status = await fetch_status(peer, cfg, secret)
        context = status.get("serving", {}).get("context")
        if context is None:
            raise Failure(f"{peer} serves no blocks: send score to a node started with --serve A-B --checkpoint DIR")
        if len(text) < context + 1:
            raise Failure(f"{file} has {len(text)} bytes; scoring needs at least a window of {context + 1} "
                          f"(the model's context + 1)")
        request = {"chunk": chunk, "seed": seed, "route": await resolve_route(peer, cfg, route, secret, status)}
        progress = Progress(log, f"scoring {file}", (len(text) - 1) // context * context, "bytes")  # (whole windows)
        return await score_text(peer, cfg, text, context, request, secret, timeout or 600.0, on_scored=progress.update)

    result = run_client(ask, f"request to {peer} failed")
    ce = result["nll"] / result["count"]
    window = result["count"] // max(result["windows"], 1)
    left = len(text) - 1 - result["count"]
    click.echo(f"{file}: {len(text)} bytes; {result['count']} predicted in {result['windows']} windows of {window}, "
               f"CE {ce:.4f} nats/byte ({ce / math.log(2):.4f} bits/byte, M = 1)")
    if left:
        click.echo(f"the last {left} bytes were not scored: they do not fill a window of {window + 1} bytes")


def run_client(ask, what: str):
    """Run a client coroutine (`ask()`) and return its result; network and protocol failures become one
    clear error that starts with `what`."""
    result: list = []

    async def main_() -> None:
        result.append(await ask())

    try:
        run_async(main_())
    except (OSError, TimeoutError, PeerGone, ProtocolError) as exc:
        raise Failure(f"{what}: {exc}") from exc
    return result[0]


async def resolve_route(peer: str, cfg: NodeConfig, route: str, secret: bytes | None,
                        status: dict | None = None) -> list:
    """[] for auto; else the named nodes (ids or unique prefixes) as route entries, from peer's status
    (`status`, if the caller has it already)."""
    if route == "auto":
        return []
    status = status or await fetch_status(peer, cfg, secret)
    members = [(status["node"], status["addr"], status.get("serves", []))]
    members += [(p["node"], p["addr"], p.get("serves", [])) for p in status["peers"]]
    hops = []
    for name in route.split(","):
        matches = [m for m in members if m[0].startswith(name.strip())]
        if len(matches) != 1 or not matches[0][2]:
            raise Failure(f"--route: {name!r} names {len(matches)} serving nodes known to {peer}; give more of its id")
        node, addr, serves = matches[0]
        hops.append([node, addr, min(serves), max(serves)])
    return hops


@main.command()
@click.argument("reference", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Where to write the codebook.")
@command
def codebook(reference, out) -> None:
    """Make a genesis codebook from the byte embedding of a trained reference in REFERENCE."""
    digest = write_genesis_codebook(reference, out)
    click.echo(f"codebook written to {out}\nsha256 {digest}\n"
               f"train every block with: --codebook-file {out} --codebook-sha256 {digest}")


T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on uvloop when it is installed, else on plain asyncio; its result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def read_secret(path: str | None) -> bytes | None:
    if path is None:
        return None
    secret = Path(path).read_bytes().strip()
    if not secret:
        raise Failure(f"secret file {path} is empty: put a long random string in it")
    return secret


@main.command()
@click.option("--listen", default="127.0.0.1:7400", show_default=True, help="HOST:PORT to serve on.")
@click.option("--peer", "peers", multiple=True, help="Seed peer HOST:PORT (repeatable).")
@click.option("--announce", default="", help="HOST:PORT peers should dial, when it differs from --listen (NAT).")
@click.option("--swarm", default="spheroid", show_default=True, help="Swarm id: nodes of other swarms are refused.")
@click.option("--secret-file", type=click.Path(exists=True, dir_okay=False),
              help="Swarm secret: peers must prove they hold it before anything else is accepted.")
@click.option("--identity", default="node-identity.json", show_default=True,
              help="Node identity file, created on first run; the peer table is saved beside it.")
@click.option("--role", default="worker", show_default=True,
              help="What this node tells its peers it is (shown in their peer tables; clients use 'client').")
@click.option("--block", "block", type=click.IntRange(min=0), default=None,
              help="Train this block with the other nodes that train it (needs --data).")
@click.option("--reference", is_flag=True,
              help="Train the whole end-to-end reference instead, with the other nodes that train it: data-parallel "
                   "replicas that average their change every --every steps (DiLoCo with --outer nesterov).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Where the training node checkpoints after every round (default node-block-<B>, or "
                   "node-reference).")
@config_option(", and a [node] table of this command's flags (every replica of a block must use the same "
               "model)")
@run_config_options
@click.option("--every", type=POSITIVE, default=AveragingConfig.every, show_default=True,
              help="H: local steps between averaging rounds.")
@click.option("--codec", type=click.Choice(sorted(CODECS)), default=AveragingConfig.codec, show_default=True,
              help="How updates travel.")
@click.option("--lz4/--no-lz4", default=AveragingConfig.lz4, show_default=True, help="lz4 on top of the codec.")
@click.option("--error-feedback/--no-error-feedback", "feedback", default=AveragingConfig.feedback, show_default=True,
              help="With a lossy codec, send what rounding lost of this node's updates and averages in later rounds.")
@click.option("--wait", type=click.FloatRange(min=0), default=AveragingConfig.wait, show_default=True,
              help="Round deadline: seconds to wait for peers' updates once this node's own is ready.")
@click.option("--outer", type=click.Choice(OUTER_STEPS), default=AveragingConfig.outer, show_default=True,
              help="Outer step: plain averaging (the paper) or Nesterov momentum on the averaged update (DiLoCo).")
@click.option("--outer-lr", type=float, default=AveragingConfig.outer_lr, show_default=True,
              help="Learning rate of the Nesterov outer step (--outer nesterov).")
@click.option("--outer-momentum", type=float, default=AveragingConfig.outer_momentum, show_default=True,
              help="Momentum of the Nesterov outer step (--outer nesterov).")
@click.option("--max-samples-ratio", type=click.FloatRange(min=1), default=AveragingConfig.max_samples_ratio,
              show_default=True, help="A peer's update weighs in with the samples it claims, up to this many times "
                                      "the median update's or this node's own, whichever is larger (raise it if "
                                      "the replicas' batches differ more; inf: no cap).")
@click.option("--serve", default=None, help="Serve these consecutive blocks for inference, e.g. 0-1 (needs "
                                             "--checkpoint).")
@click.option("--checkpoint", "serve_from", type=click.Path(exists=True, file_okay=False),
              help="Checkpoint folder the --serve blocks are loaded from.")
@click.option("--serve-reference", is_flag=True,
              help="Serve the end-to-end reference's layers for those blocks instead (the AR baseline).")
@click.option("--hop-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds a coordinated traversal may take before it is re-routed.")
@click.option("--cache-mb", type=click.FloatRange(min=0), default=256.0, show_default=True,
              help="Memory for sessions' cached keys and values (clean context; the reference's layers).")
@click.option("--session-ttl", type=click.FloatRange(min=0), default=300.0, show_default=True,
              help="Seconds an idle session's cache is kept.")
@click.option("--max-queued-hops", "max_queued", type=POSITIVE, default=128, show_default=True,
              help="Hops that may wait at this node (each holds its tensor); one more is refused as busy, and "
                   "its coordinator routes around this node or asks again after a moment.")
@click.option("--threads", type=POSITIVE, default=1, show_default=True, help="torch threads for training and serving.")
@click.option("--status-interval", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds between status lines.")
@data_option
@tls_options
@command
def node(listen, peers, announce, swarm, secret_file, identity, role, block, reference, out, config_file, every,
         codec, lz4,
         feedback, wait, outer, outer_lr, outer_momentum, max_samples_ratio, serve, serve_from, serve_reference,
         hop_timeout, cache_mb, session_ttl, max_queued, threads, status_interval, data_dir, tls_cert, tls_key,
         tls_ca, **overrides) -> None:
    """Run a node: serve the protocol, join the swarm through --peer, train --block B (or --reference) and
    serve --serve blocks if given, until Ctrl-C."""
    if block is not None and reference:
        raise click.UsageError("give one of --block B and --reference: a node trains one part of the model")
    part = REFERENCE_PART if reference else block
    try:
        served = parse_blocks(serve) if serve else None
        cfg = NodeConfig(listen=listen, peers=tuple(peers), announce=announce, swarm=swarm, identity=identity,
                         role=role, blocks=() if part is None else (part,), status_interval=status_interval,
                         tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
                         serves=tuple(range(served[0], served[1] + 1)) if served else ())
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if served and not serve_from:
        raise click.UsageError("--serve needs --checkpoint DIR holding those blocks")
    secret = read_secret(secret_file)
    ident = load_identity(cfg.identity)
    try:
        tune_allocator()
        member = Node(cfg, ident, secret)
        torch.set_num_threads(threads)
        if served and serve_reference:
            ReferenceServer(member, serve_from, *served, hop_timeout=hop_timeout, cache_mb=cache_mb,
                            session_ttl=session_ttl, max_queued=max_queued)
        elif served:
            BlockServer(member, serve_from, *served, hop_timeout=hop_timeout, cache_mb=cache_mb,
                        session_ttl=session_ttl, max_queued=max_queued)
        work = None
        if part is not None:
            run = node_run_config(config_file, overrides)
            averaging = AveragingConfig(every=every, codec=codec, lz4=lz4, feedback=feedback, wait=wait, outer=outer,
                                        outer_lr=outer_lr, outer_momentum=outer_momentum,
                                        max_samples_ratio=max_samples_ratio)
            worker = BlockWorker(member, run, averaging, part, load_bytes(data_dir, "train"),
                                 Path(out or ("node-reference" if reference else f"node-block-{block}")))
            work = worker.run
        run_async(member.run(work))
    except OSError as exc:
        raise Failure(f"the node on {listen} stopped: {exc}") from exc
    finally:
        ident.release()


def parse_replicas(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        counts = [int(n) for n in value.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise click.BadParameter(f"{value!r}: give a positive count of nodes per block, like 2,1,1,1")
    return counts


def check_node_flags(flags: list[str], part: list[str]) -> None:
    """Parse NODE_FLAGS as `spheroid node` will (with `part`: --block 0 or --reference), and build
    their configuration, so that a bad one is refused here, in one line, rather than in every node's log."""
    parent = click.get_current_context()
    try:
        with node.make_context("node", [*flags, *part], parent=parent) as ctx:
            params = ctx.params
    except click.ClickException as exc:
        raise click.UsageError(f"a node flag: {exc.format_message()}") from exc
    node_run_config(params["config_file"], {k: v for k, v in params.items() if "__" in k})


SWARM_SETS = ("--block", "--reference", "--listen", "--peer", "--identity", "--out")  # what `swarm` gives each node
SWARM_REFRESH_EVERY = 100  # steps between a swarm node's refreshes of the earlier blocks it reads


def node_run_config(config_file: str | None, overrides: dict) -> RunConfig:
    """What a training node trains: as `train`, all blocks at once (a node refreshes the earlier blocks
    it reads every SWARM_REFRESH_EVERY steps unless --refresh-every or the config file says otherwise)."""
    run = load_config(config_file, **overrides)
    if run.train.refresh_every == 0:
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, refresh_every=SWARM_REFRESH_EVERY))
    return run


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--out", type=click.Path(file_okay=False), default="runs/swarm", show_default=True,
              help="Folder for the nodes' logs and checkpoints, the assembled model and metrics.json.")
@click.option("--replicas", default="2,1,1,1", show_default=True, callback=parse_replicas,
              help="Nodes per block, comma-separated (block 0 first); the length is the number of blocks. With "
                   "--reference: one count, the reference's replicas.")
@click.option("--reference", is_flag=True,
              help="Train the end-to-end reference with --replicas data-parallel nodes (DiLoCo-style: give "
                   "--outer nesterov in NODE_FLAGS) instead of the blocks; its depth is the model's (--n-blocks x "
                   "--layers-per-block).")
@click.option("--base-port", type=click.IntRange(1, 65535), default=None,
              help="The nodes listen on 127.0.0.1 at BASE, BASE+1, ...  [default: free ports]")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=1800, show_default=True,
              help="Seconds to wait for training.")
@data_option
@click.argument("node_flags", nargs=-1, type=click.UNPROCESSED)
@command
def swarm(out, replicas, reference, base_port, timeout, data_dir, node_flags) -> None:
    """Run a swarm of trainer nodes on 127.0.0.1, one process each, until they finish; assemble it.

    NODE_FLAGS go to every `spheroid node` (model, steps, --every, --codec, ...), e.g.
    `spheroid swarm --out runs/demo -- --steps 600 --d-model 64`. The lines show each node's CE on
    its last batch and, beside it, the w(sigma)-weighted loss it minimises (larger than the CE).
    With --reference the nodes train replicas of the end-to-end reference instead, e.g.
    `spheroid swarm --reference --replicas 4 -- --outer nesterov --codec int4 --every 50`.
    """
    folder = Path(out)
    taken = {flag.split("=")[0] for flag in node_flags} & {*SWARM_SETS, *([] if reference else ["--n-blocks"])}
    if taken:
        raise click.UsageError(f"the swarm gives each node its own {', '.join(sorted(taken))} (--replicas the blocks, "
                               "--out its folder, and the addresses): leave them out of NODE_FLAGS")
    if reference and len(replicas) != 1:
        raise click.BadParameter("with --reference give one count, the replicas of the reference",
                                 param_hint="--replicas")
    flags = list(node_flags) if reference else [*node_flags, "--n-blocks", str(len(replicas))]
    check_node_flags(flags, ["--reference"] if reference else ["--block", "0"])
    parts = [(REFERENCE_PART, "ref", replicas[0])] if reference else [(b, f"b{b}", n) for b, n in enumerate(replicas)]
    with LocalSwarm(folder / "nodes", data_dir, flags) as local:
        seed = None
        for part, prefix, count in parts:
            for r in range(count):
                listen = f"127.0.0.1:{base_port + len(local.members)}" if base_port else None
                member = local.add(f"{prefix}-{chr(97 + r)}", part, seeds=[seed.listen] if seed else [], listen=listen)
                click.echo(f"{member.name:>8} | {part_name(part)} on {member.listen} | log {member.log}")
                seed = seed or member
        click.echo(f"started {len(local.members)} nodes; training (ce: CE of the last batch; weighted loss: what "
                   f"blocks minimise)...")
        members = local.wait_trained(timeout, show=click.echo)
        found = local.assemble(folder / "model")
        show_assembled(found)
        codes = local.stop()
    metrics = {"replicas": replicas, "reference": reference, "node_flags": list(node_flags),
               "nodes": {m.name: {"training": m.status["training"], "traffic": m.status["traffic"],
                                  "exit_code": codes[m.name]} for m in members},
               "assembled": [{"block": b, "holder": h, **v.to_wire()} for b, h, v in found]}
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2))
    unclean = {name: code for name, code in codes.items() if code != 0}
    if unclean:
        raise Failure(f"nodes did not stop cleanly: {unclean}; see their logs in {folder / 'nodes'}")
    click.echo(f"all {len(codes)} nodes stopped cleanly\ncheckpoint: {folder / 'model'}\n"
               f"metrics: {folder / 'metrics.json'}")


@main.command()
@click.option("--peer", callback=host_port, required=True, help="HOST:PORT of any node of the swarm.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Checkpoint folder to write.")
@client_options
@command
def assemble(peer, out, swarm, secret_file, timeout, tls_cert, tls_key, tls_ca) -> None:
    """Collect the newest state of every block from the swarm into a checkpoint `eval` and `generate` read."""
    cfg = client_config(swarm, timeout or 10.0, tls_cert, tls_key, tls_ca)
    secret = read_secret(secret_file)
    found = run_client(lambda: assemble_swarm(peer, cfg, Path(out), secret), f"cannot assemble from {peer}")
    show_assembled(found)
    click.echo(f"checkpoint in {out}")


def show_assembled(found: list) -> None:
    for part, holder, version in found:
        click.echo(f"{part_name(part)}: round {version.round}, {version.samples} samples, state "
                   f"{version.hash[:12]} from {holder}")


@main.command()
@click.option("--peer", callback=host_port, required=True, help="HOST:PORT of the node to ask.")
@client_options
@command
def status(peer, swarm, secret_file, timeout, tls_cert, tls_key, tls_ca) -> None:
    """Print a node's status (identity, peers, traffic counters) as JSON."""
    cfg = client_config(swarm, timeout or 10.0, tls_cert, tls_key, tls_ca)
    secret = read_secret(secret_file)
    result = run_client(lambda: fetch_status(peer, cfg, secret), f"cannot get the status of {peer}")
    click.echo(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
