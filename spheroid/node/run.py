"""Running a node process: what it serves, what it trains, and the loop it runs until Ctrl-C.

`spheroid node` builds a `NodeOptions` from its flags and calls `run_node`; anything else that
starts a node in-process can do the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..averaging import AveragingConfig
from ..config import NodeConfig, RunConfig
from ..data import load_bytes
from .identity import load_or_create as load_identity
from .node import Node, tune_allocator
from .serving import BlockServer, ReferenceServer
from .worker import BlockWorker

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on uvloop when it is installed, else on plain asyncio; its result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


@dataclass(frozen=True)
class ServeOptions:
    """Blocks first..last of the checkpoint in `folder` served for inference (with `reference`: the
    end-to-end reference's layers for those blocks, the autoregressive baseline)."""

    first: int
    last: int
    folder: str | Path
    reference: bool = False
    hop_timeout: float = 10.0  # seconds a coordinated traversal may take before it is re-routed
    cache_mb: float = 256.0  # memory for sessions' cached clean streams, or keys and values
    session_ttl: float = 300.0  # seconds an idle session's cache is kept
    max_queued: int = 128  # hops that may wait at the node; one more is refused as busy


@dataclass(frozen=True)
class TrainOptions:
    """Part `part` of the model (a block, or config.REFERENCE_PART: the end-to-end reference) trained
    under `run` with the swarm's other replicas of it, averaging by `averaging`, on the train split
    of the WikiText folder `data_dir` (None: $SPHEROID_DATA), checkpointing into `out`."""

    part: int
    run: RunConfig
    averaging: AveragingConfig
    data_dir: str | None
    out: Path


@dataclass(frozen=True)
class NodeOptions:
    """Everything a node process does: its membership (`node`, and the swarm `secret`), what it serves
    and trains (either, both or neither), and the torch threads it computes with."""

    node: NodeConfig
    secret: bytes | None = None
    serve: ServeOptions | None = None
    train: TrainOptions | None = None
    threads: int = 1


class NodeStopped(Exception):
    """The node stopped on an error of the system (its address taken, a file it could not read)."""


def run_node(options: NodeOptions) -> None:
    """Run a node until SIGINT/SIGTERM (or until its training fails): serve the protocol, join the
    swarm, serve and train as `options` say. An OSError while it runs becomes NodeStopped."""
    identity = load_identity(options.node.identity)
    try:
        tune_allocator()
        member = Node(options.node, identity, options.secret)
        torch.set_num_threads(options.threads)
        if (serve := options.serve) is not None:
            server = ReferenceServer if serve.reference else BlockServer
            server(member, serve.folder, serve.first, serve.last, hop_timeout=serve.hop_timeout,
                   cache_mb=serve.cache_mb, session_ttl=serve.session_ttl, max_queued=serve.max_queued)
        work = None
        if (train := options.train) is not None:
            worker = BlockWorker(member, train.run, train.averaging, train.part, load_bytes(train.data_dir, "train"),
                                 train.out)
            work = worker.run
        run_async(member.run(work))
    except OSError as exc:
        raise NodeStopped(f"the node on {options.node.listen} stopped: {exc}") from exc
    finally:
        identity.release()
