"""The commands that run nodes: node (one node process: membership, training, serving) and swarm
(a local swarm of node processes, trained and assembled)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import click

from ..averaging import OUTER_STEPS, AveragingConfig
from ..config import REFERENCE_PART, NodeConfig, RunConfig, part_name
from ..launch import LocalSwarm
from ..node.run import NodeOptions, NodeStopped, ServeOptions, TrainOptions, run_node
from ..pipeline import parse_blocks
from ..wire.tensors import CODEC_OPTIONS
from .base import (
    POSITIVE,
    Failure,
    command,
    config_option,
    data_option,
    load_config,
    main,
    read_secret,
    run_config_options,
    show_assembled,
    tls_options,
)

log = logging.getLogger("spheroid")


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
@click.option("--codec", type=click.Choice(sorted(CODEC_OPTIONS)), default=AveragingConfig.codec, show_default=True,
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
         codec, lz4, feedback, wait, outer, outer_lr, outer_momentum, max_samples_ratio, serve, serve_from,
         serve_reference, hop_timeout, cache_mb, session_ttl, max_queued, threads, status_interval, data_dir,
         tls_cert, tls_key, tls_ca, **overrides) -> None:
    """Run a node: serve the protocol, join the swarm through --peer, train --block B (or --reference) and
    serve --serve blocks if given, until Ctrl-C."""
    # (the flags become the node's options, node.run.NodeOptions, and the library runs the node)
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
    serving = ServeOptions(*served, serve_from, serve_reference, hop_timeout, cache_mb, session_ttl,
                           max_queued) if served else None
    training = None
    if part is not None:
        averaging = AveragingConfig(every=every, codec=codec, lz4=lz4, feedback=feedback, wait=wait, outer=outer,
                                    outer_lr=outer_lr, outer_momentum=outer_momentum,
                                    max_samples_ratio=max_samples_ratio)
        training = TrainOptions(part, node_run_config(config_file, overrides), averaging, data_dir,
                                Path(out or ("node-reference" if reference else f"node-block-{block}")))
    try:
        run_node(NodeOptions(cfg, secret, serving, training, threads))
    except NodeStopped as exc:
        raise Failure(str(exc)) from exc


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
               "nodes": {m.name: {"training": m.training.to_dict(), "traffic": m.status.traffic.to_dict(),
                                  "exit_code": codes[m.name]} for m in members},
               "assembled": [{"block": b, "holder": h, **v.to_wire()} for b, h, v in found]}
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2))
    unclean = {name: code for name, code in codes.items() if code != 0}
    if unclean:
        raise Failure(f"nodes did not stop cleanly: {unclean}; see their logs in {folder / 'nodes'}")
    click.echo(f"all {len(codes)} nodes stopped cleanly\ncheckpoint: {folder / 'model'}\n"
               f"metrics: {folder / 'metrics.json'}")
