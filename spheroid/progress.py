"""Log lines that must neither go silent nor flood: progress of long work (how far, how fast, when
it will be done), lines that can repeat without bound (QuietLog), and lines that carry a peer's
text (OneLineFormatter)."""

from __future__ import annotations

import logging
import time
import weakref


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


class QuietLog:
    """Log lines that can repeat without bound (one per fake peer, per refused connection) at most
    `burst` times per kind and `period`, then one line saying how many were left out: written when
    the next line of that kind comes after the period, or by `flush_all` (a node calls it with its
    status line), so a flood that stops is still counted."""

    _all: weakref.WeakSet[QuietLog] = weakref.WeakSet()

    def __init__(self, logger: logging.Logger, burst: int = 5, period: float = 10.0) -> None:
        self.logger, self.burst, self.period = logger, burst, period
        self._window: dict[str, tuple[float, int, int]] = {}  # kind -> (window start, lines in it, level)
        QuietLog._all.add(self)

    def log(self, level: int, kind: str, text: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        self._close(kind, now)
        start, count, _ = self._window.get(kind, (now, 0, level))
        self._window[kind] = (start, count + 1, level)
        if count < self.burst:
            self.logger.log(level, text, *args, exc_info=exc_info)

    def flush(self) -> None:
        """Count the lines left out of every kind whose period is over."""
        now = time.monotonic()
        for kind in list(self._window):
            self._close(kind, now)

    @classmethod
    def flush_all(cls) -> None:
        for quiet in list(cls._all):
            quiet.flush()

    def _close(self, kind: str, now: float) -> None:
        """End `kind`'s window if its period is over, saying how many of its lines were left out."""
        start, count, level = self._window.get(kind, (now, 0, 0))
        if now - start < self.period:
            return
        if count > self.burst:
            self.logger.log(level, "(%d more %s lines in %.0fs left out)", count - self.burst, kind, now - start)
        self._window.pop(kind, None)


def one_line(text: str, limit: int) -> str:
    """`text` as one line of at most about `limit` characters: control characters escaped (a newline
    shows as \\n), the rest cut with a count of what was left out."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} characters left out)"


class OneLineFormatter(logging.Formatter):
    """Formats every log message as one line of bounded length (`one_line`). A peer's strings reach
    log messages (an error's text, a hello's role and address): without this a peer could write
    lines of its own into a node's log, or fill it with one 64 KiB message. Tracebacks that follow a
    message keep their lines."""

    def __init__(self, fmt: str, limit: int = 2000) -> None:
        super().__init__(fmt)
        self.limit = limit

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = one_line(record.message, self.limit)  # (each handler's format sets it afresh)
        return super().formatMessage(record)
