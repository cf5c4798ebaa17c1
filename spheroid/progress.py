"""Progress lines for long work: how far, how fast, and when it will be done."""

from __future__ import annotations

import logging
import time


def duration(seconds: float) -> str:
    """1h02m, 3m05s or 12s."""
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


class Progress:
    """Logs "WHAT: done/total UNIT, rate, eta" at most every `every` seconds (and at the end), so that
    work of minutes shows it is moving without flooding the log."""

    def __init__(self, log: logging.Logger, what: str, total: int, unit: str, every: float = 5.0) -> None:
        self.log, self.what, self.total, self.unit, self.every = log, what, total, unit, every
        self.started = self.last = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every and done < self.total:
            return
        self.last = now
        elapsed = now - self.started
        rate = done / max(elapsed, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        self.log.info("%s: %d/%d %s, %.1f %s/s, eta %s", self.what, done, self.total, self.unit, rate, self.unit,
                      duration(eta) if eta != float("inf") else "?")
