"""A trainer's resumable state: everything a rerun needs to end on the weights an uninterrupted run ends on.

`save_resume` writes the weights, the optimizer's state (as named tensors: never pickle), the data
sampler's and the global RNG states and the step into a checkpoint entry of its own
(`<name>.resume`); `load_resume` restores them into a trainer of the same configuration. A run
stopped on request raises `Interrupted` after saving it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from . import checkpoint
from .config import RunConfig
from .loading import load_state


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """An optimizer's state (AdamW: step, first and second moments per parameter) as named tensors,
    so it can be written with safetensors and never with pickle."""
    return {f"opt.{i}.{key}": torch.as_tensor(value).contiguous()
            for i, entry in opt.state_dict()["state"].items() for key, value in entry.items()}


def load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    """The inverse of optimizer_tensors (other keys in `tensors` are ignored)."""
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("opt."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


class Interrupted(Exception):
    """Training stopped on request (SIGINT/SIGTERM) after saving a state it can resume from."""

    def __init__(self, step: int, path: Path) -> None:
        super().__init__(f"interrupted at step {step}; resumable state in {path}")
        self.step, self.path = step, path


def resume_name(name: str) -> str:
    """The checkpoint entry of a trainer's resumable state: weights, AdamW, RNGs, step."""
    return f"{name}.resume"


def save_resume(out: Path, name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator,
                cfg: RunConfig, state: dict) -> None:
    """Everything a rerun needs to continue exactly where this run is: the weights, the optimizer,
    the data sampler's and the global RNG states (the data position and the noise), the step."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    tensors.update(optimizer_tensors(opt))
    tensors["rng.global"] = torch.get_rng_state()
    tensors["rng.data"] = gen.get_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    checkpoint.save_tensors(out, resume_name(name), tensors, cfg, state)


def load_resume(out: Path, name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator,
                cfg: RunConfig) -> dict | None:
    """Restore a resumable state saved in `out` by a run of the same configuration; its record, or
    None when there is none."""
    if not (out / f"{resume_name(name)}.json").exists():
        return None
    entry = checkpoint.load(out, resume_name(name))
    if entry.config != cfg:
        changed = "; ".join(entry.config.differences(cfg))
        raise checkpoint.CheckpointError(
            f"{out} holds a resumable {name} trained with another configuration ({changed}): give the flags it was "
            f"trained with, another --out, or --fresh to start over there")
    weights = {k.removeprefix("model."): v for k, v in entry.tensors.items() if k.startswith("model.")}
    load_state(model, checkpoint.Entry(entry.name, entry.config, entry.state, weights, entry.sha256))
    load_optimizer_tensors(opt, entry.tensors)
    torch.set_rng_state(entry.tensors["rng.global"])
    gen.set_state(entry.tensors["rng.data"])
    if "rng.cuda" in entry.tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(entry.tensors["rng.cuda"])
    return entry.state


def logged_step(line: str) -> float:
    """The step of a line of a loss history; infinity for a line a killed run left half-written."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def clear_run(out: Path, name: str) -> None:
    """Forget a trainer's resumable state and loss history in `out` (--fresh)."""
    checkpoint.remove(out, resume_name(name))
    (out / f"{name}.history.jsonl").unlink(missing_ok=True)
