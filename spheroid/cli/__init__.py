"""The `spheroid` command line: a thin layer of click commands over the library.

`base` holds the command group (`main`, the console entry point) and what the commands share;
the commands are grouped by what they do: `training` (train, eval, codebook), `client` (generate,
score, status, assemble) and `swarm` (node, swarm).
"""

from __future__ import annotations

from . import client, swarm, training  # (importing them registers their commands on `main`)
from .base import EXPECTED, Failure, main, run_async
from .client import CONTROLS, ByteWriter

__all__ = ["CONTROLS", "EXPECTED", "ByteWriter", "Failure", "client", "main", "run_async", "swarm", "training"]
