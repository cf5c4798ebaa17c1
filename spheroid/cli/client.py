"""The commands that use a model: generate (here, or through a swarm's pipeline), and a swarm's
client commands: score, status, assemble."""

from __future__ import annotations

import codecs
import json
import logging
import math
import sys
from pathlib import Path

import click

from .. import checkpoint
from ..config import NodeConfig
from ..decoding import DEFAULT_DRAFT, generate_reference
from ..decoding import generate as run_chain
from ..loading import load_chain, load_reference
from ..node.client import assemble_swarm, fetch_node_status, remote_generate, score_text
from ..progress import Progress
from ..status import NodeStatus
from ..train import pick_device
from .base import (
    POSITIVE,
    Failure,
    client_config,
    client_options,
    command,
    device_option,
    finite,
    host_port,
    main,
    read_secret,
    run_client,
    show_assembled,
)

log = logging.getLogger("spheroid")


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
@click.option("--mode", type=click.Choice(["sweep", "ar", "spec"]), default="spec", show_default=True,
              help="spec (speculative: drafted bytes checked with the next one; exactly ar's output in fewer "
                   "traversals), ar (one byte per traversal) or sweep (K bytes per traversal: faster, not exact, "
                   "and worse text than ar today).")
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
        status = await fetch_node_status(peer, cfg, secret)
        if status.serving is None:
            raise Failure(f"{peer} serves no blocks: send score to a node started with --serve A-B --checkpoint DIR")
        context = status.serving.context
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


async def resolve_route(peer: str, cfg: NodeConfig, route: str, secret: bytes | None,
                        status: NodeStatus | None = None) -> list:
    """[] for auto; else the named nodes (ids or unique prefixes) as route entries, from peer's status
    (`status`, if the caller has it already)."""
    if route == "auto":
        return []
    status = status or await fetch_node_status(peer, cfg, secret)
    members = [(status.node, status.addr, status.serves)]
    members += [(p.node, p.addr, p.serves) for p in status.peers]
    hops = []
    for name in route.split(","):
        matches = [m for m in members if m[0].startswith(name.strip())]
        if len(matches) != 1 or not matches[0][2]:
            raise Failure(f"--route: {name!r} names {len(matches)} serving nodes known to {peer}; give more of its id")
        node, addr, serves = matches[0]
        hops.append([node, addr, min(serves), max(serves)])
    return hops


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


@main.command()
@click.option("--peer", callback=host_port, required=True, help="HOST:PORT of the node to ask.")
@client_options
@command
def status(peer, swarm, secret_file, timeout, tls_cert, tls_key, tls_ca) -> None:
    """Print a node's status (identity, peers, traffic counters) as JSON."""
    cfg = client_config(swarm, timeout or 10.0, tls_cert, tls_key, tls_ca)
    secret = read_secret(secret_file)
    result = run_client(lambda: fetch_node_status(peer, cfg, secret), f"cannot get the status of {peer}")
    click.echo(json.dumps(result.to_dict(), indent=2))
