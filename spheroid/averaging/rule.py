"""Whose parts count in an average, and how much: a part whose norm is far from its peers' is left
out, one weighs in with the samples it claims but at most `max_samples_ratio` times the median
part's (or the owner's own), and the rest are averaged weighted by samples, in a fixed order, so
that the same parts give the same sums anywhere. (Claimed samples cannot be checked; norms can.)"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from .config import AveragingConfig
from .parts import Part, Reduced


def norm(vector: torch.Tensor) -> float:
    """A vector's 2-norm, as the square root of its dot product with itself: one pass, about a
    quarter quicker than `vector_norm` (every part and average received is measured). NaN or Inf
    with any NaN or Inf in it, or when its squares overflow."""
    return math.sqrt(float(torch.dot(vector, vector)))


@dataclass
class Averaged:
    """An average of parts (or of rows' averages), and what the rule did to get it."""

    used: list[str]  # the senders whose parts went in, sorted
    samples: int  # the samples they count for (capped)
    average: torch.Tensor
    rejected: dict[str, str]  # sender -> why its part was left out
    capped: dict[str, int]  # sender -> the samples it counts for, where it claimed more


def average(kept: dict[str, Part | Reduced], me: str, cfg: AveragingConfig) -> Averaged:
    """The samples-weighted average of what passes the outlier check, in a fixed order (the same
    sums anywhere). `me`: the replica averaging, whose own part (if among `kept`) is trusted where
    there is no majority."""
    reference = reference_samples(kept, me)
    rejected = norm_outliers(kept, me, reference, cfg.max_norm_ratio)
    used = sorted(s for s in kept if s not in rejected)
    counted = counted_samples({s: kept[s] for s in used}, me, reference, cfg.max_samples_ratio)
    total = sum(counted.values())  # (>= 1: the median is never an outlier)
    out = torch.mul(kept[used[0]].delta, counted[used[0]] / total)
    for s in used[1:]:
        out.add_(kept[s].delta, alpha=counted[s] / total)
    capped = {s: counted[s] for s in used if counted[s] < kept[s].samples}
    return Averaged(used, total, out, rejected, capped)


def counted_samples(used: dict[str, Part | Reduced], me: str, reference: float, max_ratio: float) -> dict[str, int]:
    """The samples each part (or row's average) weighs in with: those it claims, up to `max_ratio`
    times the larger of the reference's and the averaging replica's own. Claimed samples cannot be
    checked, and uncapped they would let one peer buy the average; its own in the bound, an owner
    never caps a part no larger than its own (joiners' shares of a round pulling the median down cap
    no full part)."""
    bound = max_ratio * max(reference, used[me].samples if me in used else 0)
    if math.isinf(bound):  # (no cap asked for)
        return {sender: part.samples for sender, part in used.items()}
    cap = max(1, int(bound))
    return {sender: min(part.samples, cap) for sender, part in used.items()}


def reference_samples(parts: dict[str, Part | Reduced], me: str) -> float:
    """The samples parts are measured against: the median part's; with two there is no majority,
    and the averaging replica trusts its own."""
    if len(parts) == 2:
        return max(1, parts[me].samples)
    return max(1, statistics.median(u.samples for u in parts.values()))


def norm_outliers(parts: dict[str, Part | Reduced], me: str, ref_samples: float, ratio: float) -> dict[str, str]:
    """Parts (or rows' averages) whose norm is more than `ratio` away from the median norm (the
    averaging replica's own too: an owner must not push its own outlier into a range everyone uses).
    With two there is no majority, and the averaging replica trusts its own.

    The band's low end comes down with the samples behind a part against the reference's: an
    honest update of a share of a round's steps (a joiner's first) is that much smaller, and
    claiming fewer samples only lowers a part's weight. Its high end stays: claimed samples are
    not trusted to let a larger part in. (`ref_samples`: the parts' `reference_samples`.)"""
    if len(parts) < 2:
        return {}
    norms = {s: norm(u.delta) if u.norm is None else u.norm for s, u in parts.items()}
    two = len(norms) == 2
    ref = norms[me] if two else statistics.median(norms.values())
    out = {}
    for sender, size in norms.items():
        share = min(1.0, parts[sender].samples / ref_samples)
        if not (two and sender == me) and ref > 0 and not ref / ratio * share <= size <= ref * ratio:
            out[sender] = f"norm {size:.3g} is far outside its peers' ({ref:.3g})"
    return out
