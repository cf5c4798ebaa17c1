"""Models from checkpoint folders: the assembled chain of blocks, one block, the end-to-end reference.

checkpoint.py reads and verifies the files (records, weights, versions); this module builds the
modules they hold: a block or the reference with its weights loaded (checked against the
configuration, one line naming the first difference), in eval mode, on a device. Training,
evaluation, generation and the serving nodes all load models through it; nothing here trains.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from . import checkpoint
from .config import RunConfig
from .model import DiffusionBlock, Reference, make_codebook

Chain = tuple[RunConfig, list[DiffusionBlock], torch.Tensor]  # a loaded model: config, blocks, codebook


def load_chain(folder: str | Path, device: torch.device) -> Chain:
    """The assembled model in a checkpoint folder: its config, its blocks (eval mode) and codebook."""
    entries = checkpoint.load_blocks(folder)
    checkpoint.require_versions_read(entries, folder)
    cfg = entries[0].config
    return cfg, [block_from(e, cfg, device, b) for b, e in enumerate(entries)], make_codebook(cfg.model).to(device)


def block_from(entry: checkpoint.Entry, cfg: RunConfig, device: torch.device, index: int) -> DiffusionBlock:
    """Block `index` with the weights of `entry`, in eval mode."""
    block = DiffusionBlock(cfg.model, cfg.noise.sigma_data, index)
    load_state(block, entry)
    return block.to(device).eval()


def load_reference(folder: str | Path, device: torch.device) -> tuple[RunConfig, Reference]:
    """The end-to-end reference in a checkpoint folder: its config and the model (eval mode)."""
    entry = checkpoint.load(folder, checkpoint.REFERENCE)
    model = Reference(entry.config.model)
    load_state(model, entry)
    return entry.config, model.to(device).eval()


def load_state(module: torch.nn.Module, entry: checkpoint.Entry) -> None:
    """Load a checkpoint's weights; a mismatch is one line naming the first difference and the count."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(entry.tensors))
    unexpected = sorted(set(entry.tensors) - set(expected))
    wrong = [k for k in expected if k in entry.tensors and entry.tensors[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        first = (f"{wrong[0]} is {tuple(entry.tensors[wrong[0]].shape)} where the configuration makes "
                 f"{tuple(expected[wrong[0]].shape)}" if wrong else
                 f"{(missing or unexpected)[0]} is {'missing' if missing else 'not part of the model'}")
        raise checkpoint.CheckpointError(
            f"{entry.name}: its weights do not fit its configuration ({first}; {len(wrong)} shapes differ, "
            f"{len(missing)} missing, {len(unexpected)} unexpected): the record and the weights file belong to "
            f"different models")
    module.load_state_dict(entry.tensors)


def write_genesis_codebook(reference_folder: str | Path, out: str | Path) -> str:
    """A genesis codebook from a trained reference's byte embedding (rows normalised); its sha256.

    Every worker of a swarm then loads this file (`codebook_file`, `codebook_sha256`) instead of
    generating seeded random rows.
    """
    _, model = load_reference(reference_folder, torch.device("cpu"))
    rows = model.tok_emb.weight.detach()
    blob = save_safetensors({"codebook": (rows / rows.norm(dim=1, keepdim=True)).contiguous()})
    checkpoint.atomic_write(Path(out), blob)
    return hashlib.sha256(blob).hexdigest()
