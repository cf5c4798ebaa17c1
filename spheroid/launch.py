"""A local swarm of node processes on 127.0.0.1: what `spheroid demo` and bench/swarm.py start.

Each member is `python -m spheroid node ...` in its own process (the real CLI, real sockets) with
its own identity, checkpoint folder and log file. The launcher asks every member for its status,
prints one line per member while they train, and always reaps the processes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .averaging import Version
from .config import REFERENCE_PART, NodeConfig, part_name
from .node.client import assemble_swarm, fetch_node_status
from .status import NodeStatus, TrainingStatus

log = logging.getLogger(__name__)


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports on 127.0.0.1 that were free a moment ago (all held open while chosen)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


@dataclass
class Member:
    name: str
    block: int
    listen: str  # where the node listens
    addr: str  # where peers dial it (its --announce: a WAN-emulator link, or listen itself)
    log: Path
    proc: subprocess.Popen
    status: NodeStatus | None = None  # its last status (None: none yet)

    @property
    def training(self) -> TrainingStatus | None:
        return self.status.training if self.status is not None else None


class LocalSwarm:
    """Start trainer nodes, watch them, assemble their blocks, stop them. Use it as a context manager."""

    def __init__(self, folder: Path, data_dir: str | Path | None, run_flags: list[str]) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.data_dir = data_dir
        self.run_flags = list(run_flags)
        self.members: list[Member] = []
        self.client = NodeConfig(role="client", timeout=10.0)

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def add(self, name: str, block: int, flags: list[str] = (), seeds: list[str] = (),
            listen: str | None = None, announce: str | None = None) -> Member:
        """Start `spheroid node --block B` (`--reference` for block REFERENCE_PART) with the swarm's run
        flags, then this member's own flags."""
        listen = listen or f"127.0.0.1:{free_port()}"
        part = ["--reference"] if block == REFERENCE_PART else ["--block", str(block)]
        cmd = [sys.executable, "-m", "spheroid", "node", "--listen", listen, *part,
               "--identity", str(self.folder / f"{name}.id.json"), "--out", str(self.folder / name),
               "--status-interval", "5", *self.run_flags, *flags]
        if self.data_dir is not None:
            cmd += ["--data", str(self.data_dir)]
        if announce:
            cmd += ["--announce", announce]
        for seed in seeds:
            cmd += ["--peer", seed]
        log_path = self.folder / f"{name}.log"
        proc = subprocess.Popen(cmd, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)
        member = Member(name, block, listen, announce or listen, log_path, proc)
        self.members.append(member)
        return member

    def poll(self) -> list[Member]:
        """Refresh every live member's status (a member that does not answer keeps its last one)."""
        async def ask(member: Member) -> None:
            try:
                member.status = await fetch_node_status(member.listen, self.client)
            except Exception as exc:  # noqa: BLE001 - a node starting or gone
                log.debug("%s did not answer: %r", member.name, exc)

        async def ask_all() -> None:
            await asyncio.gather(*(ask(m) for m in self.members if m.proc.poll() is None))

        asyncio.run(ask_all())
        for member in self.members:
            if member.proc.poll() not in (None, 0):
                raise RuntimeError(f"node {member.name} exited with code {member.proc.returncode}; see {member.log}")
        return self.members

    def wait_trained(self, timeout: float, every: float = 5.0,
                     show: Callable[[str], None] | None = None) -> list[Member]:
        """Poll until every member has trained all its steps; `show` gets a member's line when it changed."""
        deadline = time.monotonic() + timeout
        shown: dict[str, str] = {}
        while True:
            members = self.poll()
            if show is not None:
                for m in members:
                    line = status_line(m)
                    if shown.get(m.name) != line:
                        show(line)
                        shown[m.name] = line
            if all(m.training is not None and m.training.done for m in members):
                return members
            if time.monotonic() > deadline:
                raise TimeoutError(f"the swarm did not finish training within {timeout:.0f}s; logs in {self.folder}")
            time.sleep(every)

    def assemble(self, out: Path) -> list[tuple[int, str, Version]]:
        return asyncio.run(assemble_swarm(self.members[0].listen, self.client, Path(out)))

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every member (a clean shutdown), SIGKILL what does not exit; their exit codes."""
        for m in self.members:
            if m.proc.poll() is None:
                m.proc.send_signal(signal.SIGTERM)
        codes = {}
        for m in self.members:
            try:
                m.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait()
            codes[m.name] = m.proc.returncode
        return codes


def status_line(member: Member) -> str:
    """step, loss, round, peers and bytes moved of one member, from its last status."""
    s, t = member.status, member.training
    if t is None:
        return f"{member.name:>8} | starting"
    moved = s.traffic.moved_bytes / 2**20
    if t.step == 0:
        return (f"{member.name:>8} | {part_name(t.block)} joined, waiting for its first step | "
                f"peers {len(s.peers)}")
    return (f"{member.name:>8} | {part_name(t.block)} step {t.step:>5}/{t.steps} "
            f"ce {t.ce:.3f} (weighted loss {t.loss:.2f}) | "
            f"round {t.round:>3} state {t.version.hash[:8]} | peers {len(s.peers)} | "
            f"moved {moved:.2f} MiB{' | done' if t.done else ''}")
