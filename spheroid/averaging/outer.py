"""The outer step: how a round's averaged update moves the shared state. "average" adds it (plain
averaging, the paper's); "nesterov" is DiLoCo's outer step, Nesterov momentum on it, whose momentum
is then part of the shared state."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import AveragingConfig
    from .state import SharedState

OUTER_STEPS = ("average", "nesterov")


def outer_step(cfg: AveragingConfig, state: SharedState, average: torch.Tensor | None, lo: int, hi: int,
               params: torch.Tensor, momentum: torch.Tensor | None) -> None:
    """Range lo:hi of the state after `state` (its parameters, and outer momentum), written into
    `params` (and `momentum`), hi - lo values each, from the averaged update there (None: it did not
    arrive, so no update). Range by range, as the ranges are assembled: one pass over the vector,
    and no vector of the average."""
    base = state.params[lo:hi]
    if average is None:
        average = torch.zeros_like(base)
    if cfg.outer == "average":
        torch.add(base, average, out=params)
        return
    old = state.momentum[lo:hi] if state.momentum is not None else torch.zeros_like(base)
    mu = cfg.outer_momentum
    torch.add(mu * old, average, out=momentum)
    torch.add(base, cfg.outer_lr * (average + mu * momentum), out=params)
