"""The `spheroid` command line: a thin layer of click commands over the library."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import sys
from pathlib import Path

import click
import torch

from . import checkpoint
from .averaging import CODECS, OUTER_STEPS, AveragingConfig
from .chain import generate as run_chain
from .config import NodeConfig, RunConfig, override
from .data import DataError, fixed_windows, load_bytes
from .launch import LocalSwarm
from .node.client import assemble_swarm, fetch_status, remote_generate, remote_score
from .node.connection import PeerGone
from .node.identity import IdentityError
from .node.identity import load_or_create as load_identity
from .node.node import Node
from .node.serving import BlockServer, ReferenceServer
from .node.worker import BlockWorker
from .pipeline import parse_blocks
from .train import (
    evaluate_bound,
    evaluate_chain,
    evaluate_reference,
    load_chain,
    pick_device,
    train_block,
    train_reference,
    write_genesis_codebook,
)
from .wire import ProtocolError

log = logging.getLogger("spheroid")


class Failure(click.ClickException):
    """An error with a message for the user: printed without a traceback, exit code 1."""


def fail_clearly(func):
    """Turn the library's expected errors into one clear line instead of a traceback."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except (DataError, checkpoint.CheckpointError, IdentityError, ValueError, FloatingPointError) as exc:
            raise Failure(str(exc)) from exc

    return wrapper


@click.group()
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors.")
def main(verbose: int, quiet: bool) -> None:
    """spheroid: decentralised training and serving of BlockTrain byte-level language models."""
    level = logging.WARNING if quiet else (logging.DEBUG if verbose > 1 else logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


data_option = click.option(
    "--data", "data_dir", envvar="SPHEROID_DATA", type=click.Path(), default=None,
    help="WikiText folder (wiki.{train,valid,test}.{tokens,raw}, plain or .xz); default $SPHEROID_DATA.",
)
device_option = click.option("--device", default=None, help="torch device; default cuda when present, else cpu.")


def load_config(config_file: str | None, **model_noise_train) -> RunConfig:
    """The run configuration: a JSON file (or the defaults) with command-line overrides on top."""
    cfg = RunConfig.from_json(Path(config_file).read_text()) if config_file else RunConfig()
    groups = {"model": {}, "noise": {}, "train": {}}
    for key, value in model_noise_train.items():
        group, field = key.split("__")
        groups[group][field] = value
    return RunConfig(
        model=override(cfg.model, **groups["model"]),
        noise=override(cfg.noise, **groups["noise"]),
        train=override(cfg.train, **groups["train"]),
    )


def run_config_options(func):
    """The model, noise and training flags shared by `train` and `node` (they override --config)."""
    options = [
        click.option("--steps", "train__steps", type=int),
        click.option("--batch", "train__batch", type=int),
        click.option("--lr", "train__lr", type=float),
        click.option("--warmup", "train__warmup", type=int, help="Steps of linear learning-rate warmup."),
        click.option("--seed", "train__seed", type=int),
        click.option("--d-model", "model__d_model", type=int),
        click.option("--n-heads", "model__n_heads", type=int),
        click.option("--layers-per-block", "model__layers_per_block", type=int),
        click.option("--n-blocks", "model__n_blocks", type=int,
                     help="Blocks of the model (for --reference: depth is n_blocks x layers_per_block)."),
        click.option("--context", "model__context", type=int),
        click.option("--chunk", "model__chunk", type=int,
                     help="K: the chunk of the attention mask blocks train with (1 = next byte; K > 1 for sweeps)."),
        click.option("--codebook-seed", "model__codebook_seed", type=int),
        click.option("--codebook-norm", "model__codebook_norm", type=float),
        click.option("--codebook-file", "model__codebook_file", help="Genesis codebook (from `spheroid codebook`)."),
        click.option("--codebook-sha256", "model__codebook_sha256", help="sha256 the genesis codebook file must have."),
        click.option("--edm-skip/--no-edm-skip", "model__edm_skip", default=None,
                     help="EDM's skip path c_skip * z in the denoiser (method.md has it; the default is without)."),
        click.option("--layout", "model__layout", type=click.Choice(["concat", "merged"]),
                     help="Block token layout: concat ([clean | noisy], any K; the default) or merged (one token "
                          "per byte, K = 1 only: half the activation memory, no sweep decoding or serving)."),
        click.option("--channel", "model__channel", type=click.Choice(["relay", "z"]),
                     help="What a block reads of the blocks before it besides z: relay (its clean stream starts "
                          "from the previous block's, so the stack computes its full depth on the context; the "
                          "default of `train`) or z only (method.md; what swarm nodes train)."),
        click.option("--reference-layout", "model__reference_layout", type=click.Choice(["plain", "two_stream"]),
                     help="--reference only: a plain causal transformer, or the blocks' two streams (a clean "
                          "stream, and a query token per position reading it)."),
        click.option("--refresh-every", "train__refresh_every", type=int,
                     help="Train all blocks at once: publish this block into --out and reload the earlier blocks' "
                          "newest snapshots every R steps (genesis states until they appear); 0 = in order."),
        click.option("--p-mean", "noise__p_mean", type=float),
        click.option("--p-std", "noise__p_std", type=float),
        click.option("--sigma-min", "noise__sigma_min", type=float),
        click.option("--sigma-max", "noise__sigma_max", type=float),
        click.option("--block-input", "train__block_input", type=click.Choice(["noised", "chain"]),
                     help="noised: e(y) + sigma eps (method.md; what swarm nodes do); chain: states of the earlier "
                          "blocks' chain, which must already be in --out (`train` only)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@main.command()
@click.option("--block", type=int, default=None, help="Train this block (0 = highest noise band).")
@click.option("--reference", is_flag=True, help="Train the end-to-end reference instead of a block.")
@click.option("--out", type=click.Path(file_okay=False), default="checkpoints/local", show_default=True,
              help="Checkpoint folder; blocks trained into one folder form the assembled model.")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False),
              help="RunConfig JSON (as written beside every checkpoint); flags override it.")
@run_config_options
@click.option("--save-every", type=int, default=0, help="Also snapshot into OUT/steps/<step>/ every N steps.")
@click.option("--metrics", type=click.Path(dir_okay=False), help="Write wall time, FLOPs and peak memory as JSON.")
@data_option
@device_option
@fail_clearly
def train(block, reference, out, config_file, save_every, metrics, data_dir, device, **overrides) -> None:
    """Train one block (--block B) or the end-to-end reference (--reference)."""
    if (block is None) == (not reference):
        raise click.UsageError("give exactly one of --block B or --reference")
    cfg = load_config(config_file, **overrides)
    dev = pick_device(device)
    data = load_bytes(data_dir, "train")
    log.info("training on %d bytes of wiki.train.tokens, device %s", data.numel(), dev)
    if reference:
        result = train_reference(cfg, data, Path(out), dev, save_every)
    else:
        result = train_block(cfg, block, data, Path(out), dev, save_every)
    click.echo(f"done in {result.wall_s:.1f}s: loss {result.final_loss:.4f} ce {result.final_ce:.4f}; "
               f"checkpoint in {out}")
    if metrics:
        Path(metrics).write_text(json.dumps({**vars(result), "config": cfg.to_dict()}, indent=2))


@main.command(name="eval")
@click.argument("ckpt", type=click.Path(exists=True, file_okay=False))
@click.option("--split", type=click.Choice(["valid", "test"]), default="valid", show_default=True)
@click.option("--variant", type=click.Choice(["tokens", "raw"]), default="tokens", show_default=True)
@click.option("--k", "chunk", type=int, default=None, help="Chunk size of the attention mask (default: trained K).")
@click.option("--draws", type=int, default=8, show_default=True, help="M: noise draws averaged.")
@click.option("--steps-per-block", type=int, default=None, help="Euler steps per block (default: as trained).")
@click.option("--churn", type=float, default=None, help="Stochastic sampler: noise re-injected per step.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--windows", type=int, default=256, show_default=True, help="Evaluation windows, evenly spaced.")
@click.option("--bound", is_flag=True, help="Also the variational bound (VDM) of the blocks' diffusion model.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@data_option
@device_option
@fail_clearly
def evaluate(ckpt, split, variant, chunk, draws, steps_per_block, churn, seed, windows, bound, as_json, data_dir,
             device) -> None:
    """CE of the chain in CKPT started from pure noise with a clean context (and of a reference there)."""
    dev = pick_device(device)
    results: dict[str, float | int | str] = {"split": f"wiki.{split}.{variant}", "draws": draws}
    have_blocks = bool(checkpoint.block_indices(ckpt))
    have_reference = (Path(ckpt) / f"{checkpoint.REFERENCE}.json").exists()
    if not (have_blocks or have_reference):
        raise Failure(f"{ckpt} holds neither blocks nor a reference checkpoint")
    context = checkpoint.load(ckpt, "block-0" if have_blocks else checkpoint.REFERENCE).config.model.context
    win = fixed_windows(load_bytes(data_dir, split, variant), windows, context + 1)
    results["bytes"] = win.shape[0] * context
    if have_blocks:
        trained = checkpoint.load(ckpt, "block-0").config.noise
        noise = override(trained, steps_per_block=steps_per_block, churn=churn)
        chain, alone = evaluate_chain(ckpt, win, draws, seed, dev, chunk, noise)
        results.update(chain_ce_m1=chain.ce_one_draw, chain_ce=chain.ce_averaged, block0_alone_ce=alone)
        if bound:
            terms = evaluate_bound(ckpt, win, seed, dev)
            results.update(bound_ce=terms.total, bound_prior=terms.prior, bound_diffusion=terms.diffusion,
                           bound_reconstruction=terms.reconstruction)
    if have_reference:
        results["reference_ce"] = evaluate_reference(ckpt, win, dev)
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    click.echo(f"{results['split']}: {results['bytes']} bytes scored")
    rows = [("chain_ce_m1", "chain from noise, M = 1"), ("chain_ce", f"chain from noise, M = {draws}"),
            ("block0_alone_ce", "block 0 alone at sigma_max"), ("bound_ce", "variational bound (VDM)"),
            ("reference_ce", "end-to-end reference")]
    for key, label in rows:
        if key in results:
            ce = float(results[key])
            bits, ppl = ce / math.log(2), math.exp(ce)
            click.echo(f"  {label:<30} CE {ce:.4f} nats/byte  {bits:.4f} bits/byte  PPL {ppl:.3f}")


@main.command()
@click.argument("target", required=False)
@click.option("--peer", default=None, help="Generate through the pipeline this serving node coordinates; "
                                          "TARGET is then the prompt.")
@click.option("--prompt", default="", help="Text to continue (locally; with --peer give it as TARGET).")
@click.option("--bytes", "n_bytes", type=int, default=200, show_default=True)
@click.option("--mode", type=click.Choice(["sweep", "ar"]), default="sweep", show_default=True,
              help="With --peer: sweep (K bytes per traversal) or ar (one byte per traversal, streamed).")
@click.option("--k", "chunk", type=int, default=None, help="Bytes denoised per traversal (default 1; "
                                                          "with --mode sweep, all --bytes at once).")
@click.option("--route", default="auto", show_default=True,
              help="With --peer: auto (from membership, lowest RTT) or node ids (or prefixes) A,B,C in order.")
@click.option("--temperature", type=float, default=0.8, show_default=True, help="0 = most likely byte.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--timeout", type=float, default=300.0, show_default=True, help="With --peer: seconds in all.")
@device_option
@fail_clearly
def generate(target, peer, prompt, n_bytes, mode, chunk, route, temperature, seed, timeout, device) -> None:
    """Generate bytes: `generate CKPT --prompt TEXT` locally, or `generate --peer HOST:PORT TEXT` in a swarm."""
    if peer is None:
        if target is None or not Path(target).is_dir():
            raise click.UsageError("give a checkpoint folder (or --peer HOST:PORT to use a swarm)")
        dev = pick_device(device)
        cfg, blocks, codebook = load_chain(target, dev)
        text = run_chain(blocks, cfg.noise, codebook, prompt.encode(), n_bytes, chunk or 1, temperature, seed)
        click.echo(prompt + text.decode("utf-8", errors="replace"))
        return
    prompt = target if target is not None else prompt
    k = chunk or (n_bytes if mode == "sweep" else 1)
    cfg = NodeConfig(role="client", timeout=min(timeout, 30.0))
    stdout = click.get_binary_stream("stdout")  # the model's bytes as they are, as they come

    def show(data: bytes) -> None:
        stdout.write(data)
        stdout.flush()

    show(prompt.encode())

    async def ask() -> dict:
        hops = await resolve_route(peer, cfg, route)
        request = {"prompt": prompt.encode(), "n_bytes": n_bytes, "mode": mode, "k": k,
                   "temperature": temperature, "seed": seed, "route": hops}
        return await remote_generate(peer, cfg, request, on_bytes=show, timeout=timeout)

    result = run_client(ask, f"request to {peer} failed")
    show(b"\n")
    log.info("%d bytes in %d traversals via %s", result["bytes"], result["traversals"],
             " -> ".join(h[0][:8] for h in result["route"]))


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--peer", required=True, help="A serving node: it coordinates the request.")
@click.option("--k", "chunk", type=int, default=1, show_default=True, help="Chunk size of the attention mask.")
@click.option("--route", default="auto", show_default=True, help="auto, or node ids (or prefixes) A,B,C.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--timeout", type=float, default=600.0, show_default=True)
@fail_clearly
def score(file, peer, chunk, route, seed, timeout) -> None:
    """CE of FILE through the swarm's pipeline: one traversal per window, one draw (M = 1)."""
    text = Path(file).read_bytes()
    cfg = NodeConfig(role="client", timeout=min(timeout, 30.0))

    async def ask() -> dict:
        request = {"text": text, "chunk": chunk, "seed": seed, "route": await resolve_route(peer, cfg, route)}
        return await remote_score(peer, cfg, request, timeout=timeout)

    result = run_client(ask, f"request to {peer} failed")
    ce = result["nll"] / result["count"]
    click.echo(f"{file}: {result['count']} bytes in {result['windows']} windows, CE {ce:.4f} nats/byte "
               f"({ce / math.log(2):.4f} bits/byte, M = 1)")


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


async def resolve_route(peer: str, cfg: NodeConfig, route: str) -> list:
    """[] for auto; else the named nodes (ids or unique prefixes) as route entries, from peer's status."""
    if route == "auto":
        return []
    status = await fetch_status(peer, cfg)
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
@fail_clearly
def codebook(reference, out) -> None:
    """Make a genesis codebook from the byte embedding of a trained reference in REFERENCE."""
    digest = write_genesis_codebook(reference, out)
    click.echo(f"codebook written to {out}\nsha256 {digest}\n"
               f"train every block with: --codebook-file {out} --codebook-sha256 {digest}")


def run_async(coro) -> None:
    """Run a coroutine on uvloop when it is installed, else on plain asyncio."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def read_secret(path: str | None) -> bytes | None:
    if path is None:
        return None
    secret = Path(path).read_bytes().strip()
    if not secret:
        raise Failure(f"secret file {path} is empty: put a long random string in it")
    return secret


def tls_options(func):
    for name, text in (("--tls-ca", "CA certificate: verify peers against it (mutual TLS)."),
                       ("--tls-key", "TLS private key (PEM)."), ("--tls-cert", "TLS certificate (PEM).")):
        func = click.option(name, type=click.Path(exists=True, dir_okay=False), help=text)(func)
    return func


@main.command()
@click.option("--listen", default="127.0.0.1:7400", show_default=True, help="HOST:PORT to serve on.")
@click.option("--peer", "peers", multiple=True, help="Seed peer HOST:PORT (repeatable).")
@click.option("--announce", default="", help="HOST:PORT peers should dial, when it differs from --listen (NAT).")
@click.option("--swarm", default="spheroid", show_default=True, help="Swarm id: nodes of other swarms are refused.")
@click.option("--secret-file", type=click.Path(exists=True, dir_okay=False),
              help="Swarm secret: peers must prove they hold it before anything else is accepted.")
@click.option("--identity", default="node-identity.json", show_default=True,
              help="Node identity file, created on first run; the peer table is saved beside it.")
@click.option("--role", default="worker", show_default=True)
@click.option("--block", "block", type=int, default=None,
              help="Train this block with the other nodes that train it (needs --data).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Where the training node checkpoints after every round (default node-block-<B>).")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False),
              help="RunConfig JSON; flags override it. Every replica of a block must use the same model.")
@run_config_options
@click.option("--every", type=int, default=AveragingConfig.every, show_default=True,
              help="H: local steps between averaging rounds.")
@click.option("--codec", type=click.Choice(sorted(CODECS)), default=AveragingConfig.codec, show_default=True,
              help="How updates travel.")
@click.option("--lz4/--no-lz4", default=AveragingConfig.lz4, show_default=True, help="lz4 on top of the codec.")
@click.option("--wait", type=float, default=AveragingConfig.wait, show_default=True,
              help="Round deadline: seconds to wait for peers' updates once this node's own is ready.")
@click.option("--outer", type=click.Choice(OUTER_STEPS), default=AveragingConfig.outer, show_default=True,
              help="Outer step: plain averaging (the paper) or Nesterov momentum on the averaged update (DiLoCo).")
@click.option("--outer-lr", type=float, default=AveragingConfig.outer_lr, show_default=True)
@click.option("--outer-momentum", type=float, default=AveragingConfig.outer_momentum, show_default=True)
@click.option("--serve", default=None, help="Serve these consecutive blocks for inference, e.g. 0-1 (needs "
                                             "--checkpoint).")
@click.option("--checkpoint", "serve_from", type=click.Path(exists=True, file_okay=False),
              help="Checkpoint folder the --serve blocks are loaded from.")
@click.option("--serve-reference", is_flag=True,
              help="Serve the end-to-end reference's layers for those blocks instead (the AR baseline).")
@click.option("--hop-timeout", type=float, default=10.0, show_default=True,
              help="Seconds a coordinated traversal may take before it is re-routed.")
@click.option("--cache-mb", type=float, default=256.0, show_default=True,
              help="Memory for sessions' cached keys and values (clean context; the reference's layers).")
@click.option("--session-ttl", type=float, default=300.0, show_default=True,
              help="Seconds an idle session's cache is kept.")
@click.option("--threads", type=int, default=1, show_default=True, help="torch threads for training and serving.")
@click.option("--status-interval", type=float, default=5.0, show_default=True, help="Seconds between status lines.")
@data_option
@tls_options
@fail_clearly
def node(listen, peers, announce, swarm, secret_file, identity, role, block, out, config_file, every, codec, lz4,
         wait, outer, outer_lr, outer_momentum, serve, serve_from, serve_reference, hop_timeout, cache_mb, session_ttl,
         threads, status_interval, data_dir, tls_cert, tls_key, tls_ca, **overrides) -> None:
    """Run a node: serve the protocol, join the swarm through --peer, train --block B and serve --serve
    blocks if given, until Ctrl-C."""
    served = parse_blocks(serve) if serve else None
    if served and not serve_from:
        raise click.UsageError("--serve needs --checkpoint DIR holding those blocks")
    cfg = NodeConfig(listen=listen, peers=tuple(peers), announce=announce, swarm=swarm, identity=identity, role=role,
                     blocks=() if block is None else (block,), status_interval=status_interval, tls_cert=tls_cert,
                     tls_key=tls_key, tls_ca=tls_ca,
                     serves=tuple(range(served[0], served[1] + 1)) if served else ())
    secret = read_secret(secret_file)
    ident = load_identity(cfg.identity)
    try:
        member = Node(cfg, ident, secret)
        torch.set_num_threads(threads)
        if served and serve_reference:
            ReferenceServer(member, serve_from, *served, hop_timeout=hop_timeout, cache_mb=cache_mb,
                            session_ttl=session_ttl)
        elif served:
            BlockServer(member, serve_from, *served, hop_timeout=hop_timeout, cache_mb=cache_mb,
                        session_ttl=session_ttl)
        work = None
        if block is not None:
            overrides["train__block_input"] = overrides.get("train__block_input") or "noised"
            overrides["model__channel"] = overrides.get("model__channel") or "z"
            run = load_config(config_file, **overrides)
            averaging = AveragingConfig(every=every, codec=codec, lz4=lz4, wait=wait, outer=outer, outer_lr=outer_lr,
                                        outer_momentum=outer_momentum)
            worker = BlockWorker(member, run, averaging, block, load_bytes(data_dir, "train"),
                                 Path(out or f"node-block-{block}"))
            work = worker.run
        run_async(member.run(work))
    except OSError as exc:
        raise Failure(f"cannot serve on {listen}: {exc}") from exc
    finally:
        ident.release()


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--out", type=click.Path(file_okay=False), default="runs/swarm", show_default=True,
              help="Folder for the nodes' logs and checkpoints, the assembled model and metrics.json.")
@click.option("--replicas", default="2,1,1,1", show_default=True,
              help="Nodes per block, comma-separated (block 0 first); the length is the number of blocks.")
@click.option("--timeout", type=float, default=1800, show_default=True, help="Seconds to wait for training.")
@data_option
@click.argument("node_flags", nargs=-1, type=click.UNPROCESSED)
@fail_clearly
def swarm(out, replicas, timeout, data_dir, node_flags) -> None:
    """Run a swarm of trainer nodes on 127.0.0.1, one process each, until they finish; assemble it.

    NODE_FLAGS go to every `spheroid node` (model, steps, --every, --codec, ...), e.g.
    `spheroid swarm --out runs/demo -- --steps 600 --d-model 64`.
    """
    counts = [int(n) for n in replicas.split(",")]
    if not counts or min(counts) < 1:
        raise click.UsageError("--replicas needs a positive count per block, like 2,1,1,1")
    folder = Path(out)
    flags = [*node_flags, "--n-blocks", str(len(counts))]
    with LocalSwarm(folder / "nodes", data_dir, flags) as local:
        seed = None
        for block, count in enumerate(counts):
            for r in range(count):
                member = local.add(f"b{block}-{chr(97 + r)}", block, seeds=[seed.listen] if seed else [])
                seed = seed or member
        click.echo(f"started {len(local.members)} nodes (logs in {folder / 'nodes'}); training...")
        members = local.wait_trained(timeout, show=click.echo)
        found = local.assemble(folder / "model")
        for block, holder, version in found:
            click.echo(f"block {block}: round {version.round}, {version.samples} samples, state {version.hash[:12]} "
                       f"from {holder}")
        codes = local.stop()
    metrics = {"replicas": counts, "node_flags": list(node_flags),
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
@click.option("--peer", required=True, help="HOST:PORT of any node of the swarm.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Checkpoint folder to write.")
@click.option("--swarm", default="spheroid", show_default=True)
@click.option("--secret-file", type=click.Path(exists=True, dir_okay=False))
@click.option("--timeout", type=float, default=10.0, show_default=True)
@tls_options
@fail_clearly
def assemble(peer, out, swarm, secret_file, timeout, tls_cert, tls_key, tls_ca) -> None:
    """Collect the newest state of every block from the swarm into a checkpoint `eval` and `generate` read."""
    cfg = NodeConfig(swarm=swarm, role="client", timeout=timeout, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca)
    secret = read_secret(secret_file)
    found = run_client(lambda: assemble_swarm(peer, cfg, Path(out), secret), f"cannot assemble from {peer}")
    for block, holder, version in found:
        click.echo(f"block {block}: round {version.round}, {version.samples} samples, state {version.hash[:12]} "
                   f"from {holder}")
    click.echo(f"checkpoint in {out}")


@main.command()
@click.option("--peer", required=True, help="HOST:PORT of the node to ask.")
@click.option("--swarm", default="spheroid", show_default=True)
@click.option("--secret-file", type=click.Path(exists=True, dir_okay=False))
@click.option("--timeout", type=float, default=10.0, show_default=True)
@tls_options
@fail_clearly
def status(peer, swarm, secret_file, timeout, tls_cert, tls_key, tls_ca) -> None:
    """Print a node's status (identity, peers, traffic counters) as JSON."""
    cfg = NodeConfig(swarm=swarm, role="client", timeout=timeout, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca)
    secret = read_secret(secret_file)
    result = run_client(lambda: fetch_status(peer, cfg, secret), f"cannot get the status of {peer}")
    click.echo(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
