"""WikiText folders as byte streams, and random or fixed windows of them.

Bytes are tokens, so a split is one uint8 tensor. Batches are gathered by index arithmetic from that
one tensor: nothing is copied per batch except the batch itself.
"""

from __future__ import annotations

import lzma
import os
from pathlib import Path

import torch

SPLITS = ("train", "valid", "test")
VARIANTS = ("tokens", "raw")
ENV_VAR = "SPHEROID_DATA"


class DataError(Exception):
    """The data folder is missing, unreadable or lacks a file that was asked for."""


def expected_files() -> str:
    names = [f"wiki.{s}.{v}" for s in SPLITS for v in VARIANTS]
    return ", ".join(names) + " (each plain or .xz)"


def resolve_folder(folder: str | os.PathLike | None) -> Path:
    """The data folder: the argument, else $SPHEROID_DATA; a clear error when neither works."""
    if folder is None or str(folder) == "":
        folder = os.environ.get(ENV_VAR)
    if not folder:
        raise DataError(
            f"no data folder given: pass --data DIR or set {ENV_VAR} to a WikiText-2 or WikiText-103 "
            f"folder holding {expected_files()}"
        )
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise DataError(f"data folder {path} does not exist or is not a folder; expected {expected_files()}")
    return path


def split_path(folder: str | os.PathLike | None, split: str, variant: str = "tokens") -> Path:
    """The file of one split: `wiki.<split>.<variant>`, plain or xz-compressed."""
    if split not in SPLITS or variant not in VARIANTS:
        raise DataError(f"unknown split {split!r}/{variant!r}: splits {SPLITS}, variants {VARIANTS}")
    root = resolve_folder(folder)
    for name in (f"wiki.{split}.{variant}", f"wiki.{split}.{variant}.xz"):
        if (root / name).is_file():
            return root / name
    present = sorted(p.name for p in root.iterdir())[:12]
    raise DataError(
        f"{root} has no wiki.{split}.{variant}[.xz]; expected {expected_files()}; found {present or 'nothing'}"
    )


def load_bytes(folder: str | os.PathLike | None, split: str, variant: str = "tokens") -> torch.Tensor:
    """One split as a 1-D uint8 tensor of its bytes."""
    path = split_path(folder, split, variant)
    try:
        if path.suffix == ".xz":
            with lzma.open(path, "rb") as f:
                raw = f.read()
        else:
            raw = path.read_bytes()
    except (OSError, lzma.LZMAError, EOFError) as exc:  # (EOFError: an .xz cut short)
        raise DataError(f"cannot read {path}: {exc or 'it ends before its compressed stream does'}; "
                        f"re-fetch it") from exc
    if len(raw) < 2:
        raise DataError(f"{path} holds {len(raw)} bytes: too short to train or evaluate on")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def random_windows(data: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`batch` random contiguous windows of `length` bytes, as int64 (batch, length)."""
    if data.numel() < length:
        raise DataError(f"corpus of {data.numel()} bytes is shorter than one window of {length}")
    starts = torch.randint(0, data.numel() - length + 1, (batch,), generator=generator)
    return gather_windows(data, starts, length)


def fixed_windows(data: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """`count` windows spread evenly over the whole split: the same every time, for evaluation."""
    if data.numel() < length:
        raise DataError(f"corpus of {data.numel()} bytes is shorter than one window of {length}")
    last = data.numel() - length
    starts = torch.linspace(0, last, count).round().long()
    return gather_windows(data, starts, length)


def gather_windows(data: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    index = starts[:, None] + torch.arange(length)[None, :]  # (batch, length)
    return data[index].long()
