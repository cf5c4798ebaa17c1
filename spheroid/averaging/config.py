"""How same-block replicas average: the settings of the rounds, checked once, and stated by every benchmark."""

from __future__ import annotations

from dataclasses import dataclass

from ..wire.tensors import CODEC_OPTIONS
from .outer import OUTER_STEPS


@dataclass(frozen=True)
class AveragingConfig:
    """How same-block replicas average. Every benchmark states these."""

    every: int = 20  # H: local steps per round
    codec: str = "fp32"  # how updates travel: a codec's config name (spheroid.wire.tensors.CODEC_OPTIONS)
    lz4: bool = False  # lz4 on top of the codec, kept per chunk only where it shrinks the data
    wait: float = 5.0  # seconds a replica waits for its peers' updates once its own is ready
    outer: str = "average"  # "average": plain averaging (the paper); "nesterov": DiLoCo's outer step
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    max_norm_ratio: float = 10.0  # an update whose norm is this far from its peers' is rejected
    # a part weighs in with the samples it claims, but at most this many times the median part's (or
    # the owner's own, if larger): a peer cannot outweigh its peers by claiming samples it did not
    # train (its norm is checked; its samples cannot be)
    max_samples_ratio: float = 4.0
    flat: int = 16  # groups up to this size average in one row; larger ones in rows and columns (`Layout`)
    # error feedback (lossy codecs): what the codec lost of this replica's parts, and of the ranges
    # it averaged, is added to what it sends next round, so no progress is lost to rounding
    feedback: bool = False

    @property
    def lossy(self) -> bool:
        return CODEC_OPTIONS[self.codec].lossy

    def __post_init__(self) -> None:
        if self.codec not in CODEC_OPTIONS:
            raise ValueError(f"codec must be one of {sorted(CODEC_OPTIONS)}, got {self.codec!r}")
        if self.outer not in OUTER_STEPS:
            raise ValueError(f"outer must be one of {OUTER_STEPS}, got {self.outer!r}")
        if (self.every < 1 or self.wait <= 0 or self.max_norm_ratio <= 1 or not self.max_samples_ratio >= 1
                or self.flat < 1):  # (not >= 1: NaN too)
            raise ValueError("need every >= 1, wait > 0, max_norm_ratio > 1, max_samples_ratio >= 1 and flat >= 1")
        if CODEC_OPTIONS[self.codec].needs_feedback and not self.feedback:  # (int2: see its class)
            raise ValueError(f"the {self.codec} codec needs error feedback (--error-feedback)")
