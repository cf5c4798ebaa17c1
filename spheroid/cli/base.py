"""The command group of `spheroid`, and what its commands share: their common options and error
handling, the model/noise/training flags and config files, the checks of flag values, and how a
client reaches a swarm."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import re
import sys
import tomllib
from pathlib import Path

import click
import torch

from .. import checkpoint
from ..config import (
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
from ..data import DataError
from ..node.connection import PeerGone
from ..node.identity import IdentityError
from ..node.run import run_async
from ..progress import OneLineFormatter
from ..wire import ProtocolError

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


def read_secret(path: str | None) -> bytes | None:
    if path is None:
        return None
    secret = Path(path).read_bytes().strip()
    if not secret:
        raise Failure(f"secret file {path} is empty: put a long random string in it")
    return secret


def show_assembled(found: list) -> None:
    for part, holder, version in found:
        click.echo(f"{part_name(part)}: round {version.round}, {version.samples} samples, state "
                   f"{version.hash[:12]} from {holder}")
