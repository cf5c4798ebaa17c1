"""Checkpoints: one safetensors file per block (or the reference) with a JSON record beside it.

A checkpoint folder holds `block-<b>.json` and the weights file it names for each block, and
optionally `reference.json` and its weights. The JSON holds the full run configuration (model,
noise, codebook seed, training), the training state, and the name and sha256 of its weights file,
which is named for its content (`block-0.<16 hex digits of its sha256>.safetensors`; earlier
versions wrote `block-0.safetensors`, still read). Files are written atomically (temp file, fsync,
rename): the new weights under their own name, then the JSON, the commit point, and only then are
the old weights deleted. So a crash at any moment of a save leaves the previous checkpoint or the
new one loadable, and a damaged file is refused, never loaded. No pickle: safetensors holds only
tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .config import RunConfig

FORMAT = "spheroid-checkpoint/1"


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, damaged or inconsistent."""


@dataclass
class Entry:
    """One module in a checkpoint folder: its weights, configuration and training state."""

    name: str
    config: RunConfig
    state: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    sha256: str  # of the weights file: which version of the module this is


def block_name(block: int) -> str:
    return f"block-{block}"


REFERENCE = "reference"


def atomic_write(path: Path, data: bytes) -> None:
    """Write data to path so that readers see either the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save(folder: str | os.PathLike, name: str, module: torch.nn.Module, config: RunConfig,
         state: dict[str, Any]) -> Path:
    """Save a module's weights and record; returns the JSON path."""
    return save_tensors(folder, name, module.state_dict(), config, state)


def save_tensors(folder: str | os.PathLike, name: str, tensors: dict[str, torch.Tensor], config: RunConfig,
                 state: dict[str, Any]) -> Path:
    """Save named tensors (weights, or a trainer's whole state) and their record; returns the JSON path."""
    folder = Path(folder)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    # one metadata entry: safetensors writes them in a random order, and the same weights would then
    # get another sha256 (and file name) from one save to the next
    blob = save_safetensors(tensors, metadata={"format": FORMAT})
    sha = hashlib.sha256(blob).hexdigest()
    weights = f"{name}.{sha[:16]}.safetensors"
    atomic_write(folder / weights, blob)
    record = {"format": FORMAT, "name": name, "weights": weights, "sha256": sha, "config": config.to_dict(),
              "state": state}
    path = folder / f"{name}.json"
    atomic_write(path, json.dumps(record, indent=2, sort_keys=True).encode())
    for old in weights_files(folder, name):
        if old.name != weights:
            old.unlink(missing_ok=True)
    return path


def weights_files(folder: Path, name: str) -> list[Path]:
    """The weights files of module `name` in a folder: the one its record names, and any a crash
    between a save's steps left behind."""
    pattern = re.compile(re.escape(name) + r"(\.[0-9a-f]{16})?\.safetensors")
    return [p for p in folder.glob(f"{name}.*safetensors") if pattern.fullmatch(p.name)]


def remove(folder: str | os.PathLike, name: str) -> None:
    """Delete module `name`'s checkpoint from a folder: its record first, then its weights."""
    folder = Path(folder)
    (folder / f"{name}.json").unlink(missing_ok=True)
    for path in weights_files(folder, name):
        path.unlink(missing_ok=True)


def read_config(folder: str | os.PathLike, name: str) -> RunConfig:
    """The configuration a module's record holds, the record checked but its weights not read (a
    clear CheckpointError on anything wrong): to check a folder before the work that loads it."""
    return _record(Path(folder), name)[0]


def load(folder: str | os.PathLike, name: str) -> Entry:
    """Load and verify one module's checkpoint; a clear CheckpointError on anything wrong."""
    folder = Path(folder)
    config, weights, expected, state = _record(folder, name)
    path = folder / f"{name}.json"
    weights = folder / weights
    try:
        blob = weights.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {weights}: {exc}") from exc
    actual = hashlib.sha256(blob).hexdigest()
    if actual != expected:
        raise CheckpointError(
            f"{weights} ({len(blob)} bytes, sha256 {actual[:12]}) does not match the sha256 {str(expected)[:12]} "
            f"recorded in {path}: one of the two is damaged, truncated or altered; restore both from a peer or a backup"
        )
    try:
        tensors = load_safetensors(blob)
    except SafetensorError as exc:
        raise CheckpointError(f"{weights} is not a valid safetensors file: {exc}") from exc
    return Entry(name, config, state, tensors, actual)


def _record(folder: Path, name: str) -> tuple[RunConfig, str, Any, dict]:
    """A module's record, checked: its configuration, weights file name, their recorded sha256, state."""
    path = folder / f"{name}.json"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: is {folder} a spheroid checkpoint folder?") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable or not JSON ({exc}); re-save or re-fetch it") from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} record")
    try:
        config = RunConfig.from_dict(record["config"])
        weights, expected, state = record["weights"], record["sha256"], record.get("state", {})
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path} has a malformed record: {exc}") from exc
    if record.get("name") != name:
        raise CheckpointError(f"{path} is the record of {record.get('name')!r}, not of {name!r}: was it renamed? "
                              f"Restore the folder's files under their own names")
    if not isinstance(weights, str) or Path(weights).name != weights or not weights.endswith(".safetensors"):
        raise CheckpointError(f"{path} names weights {weights!r}, not a .safetensors file beside it")
    if not isinstance(state, dict) or not isinstance(state.get("reads") or {}, dict) or not all(
            isinstance(read, dict) for read in (state.get("reads") or {}).values()):
        raise CheckpointError(f"{path} has a malformed record: its state must be a map, and its reads a map of maps")
    return config, weights, expected, state


def block_indices(folder: str | os.PathLike) -> list[int]:
    """Indices of the blocks that have a record in the folder, sorted."""
    found = (re.fullmatch(r"block-(\d+)\.json", p.name) for p in Path(folder).glob("block-*.json"))
    return sorted(int(m.group(1)) for m in found if m)


def load_blocks(folder: str | os.PathLike) -> list[Entry]:
    """All blocks of an assembled model; refuses a folder with a block missing or configs that differ."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    indices = block_indices(folder)
    if not indices:
        raise CheckpointError(f"{folder} holds no block-<b>.json: train blocks with `spheroid train --block B`")
    entries = [load(folder, block_name(b)) for b in indices]
    first = entries[0].config
    n_blocks = first.model.n_blocks
    if missing := sorted(set(range(n_blocks)) - set(indices)):
        raise CheckpointError(f"{folder} lacks block(s) {missing} of {n_blocks}; train or fetch them first")
    if extra := [b for b in indices if b >= n_blocks]:
        raise CheckpointError(f"{folder} holds block(s) {extra} beyond the {n_blocks} of its block 0's model (left "
                              f"from another model?): move them out of the folder")
    for e in entries[1:]:
        require_same_model(e, first, folder, "block-0")
    return entries


def require_versions_read(entries: list[Entry], folder: str | os.PathLike) -> None:
    """Refuse blocks that were trained against other versions of the earlier blocks than the folder holds.

    A block records the versions it read (`state["reads"]`: sha256 and step per earlier block, or the
    round, samples and hash of a swarm's state). Blocks trained in order read fixed versions, which
    must be the ones here; blocks trained all at once (refresh_every > 0) read snapshots, and the
    folder must hold the same or a later step (a swarm's: round) of each.
    """
    held = {e.name: e for e in entries}
    for entry in entries:
        refreshed = entry.config.train.refresh_every > 0
        for name, read in (entry.state.get("reads") or {}).items():
            other = held.get(name)
            if other is None:
                continue
            progress = "round" if "round" in read else "step"
            if refreshed and int(other.state.get(progress, 0)) >= int(read.get(progress, 0)):
                continue
            if not refreshed and other.sha256 == read.get("sha256"):
                continue
            found = f"{progress} {other.state.get(progress, '?')}, sha256 {other.sha256[:12]}"
            wanted = f"{progress} {read.get(progress, '?')}, {'hash' if 'hash' in read else 'sha256'} " \
                     f"{str(read.get('hash', read.get('sha256')))[:12]}"
            raise CheckpointError(
                f"{entry.name} in {folder} was trained against {name} at {wanted}, but the folder holds {found}: "
                f"retrain {entry.name} (and the blocks after it) on this {name}, or restore the {name} it read"
            )


def require_same_model(entry: Entry, cfg: RunConfig, folder: str | os.PathLike, other: str) -> None:
    """Refuse a block trained for another model or noise schedule than `cfg` (named `other`)."""
    if entry.config.model != cfg.model or entry.config.noise != cfg.noise:
        raise CheckpointError(
            f"{entry.name} in {folder} was trained with another model or noise configuration than {other}"
        )
