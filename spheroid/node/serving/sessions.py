"""What a serving node keeps of a session between its traversals, bounded and expiring, and the
refusals that say a hop cannot run here (now)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...model import CleanStream, KVCache


class StaleSession(ValueError):
    """A hop assumes session state this node no longer holds (evicted, or expired): the traversal
    must start over on a new session."""


class Busy(ValueError):
    """Too many hops wait at this node already: the traversal may be asked again in a moment."""


@dataclass
class Session:
    """What a serving node keeps of one session between traversals: its caches (a clean stream per
    block, or keys and values per layer), and the bytes they were computed from."""

    make: Callable[[], list[CleanStream] | list[KVCache]]
    caches: list = field(default_factory=list)
    tokens: bytes = b""
    used: float = field(default_factory=time.monotonic)
    relayed: tuple[str, int] = ("", 0)  # (next hop, positions of the relayed clean stream it holds)

    def __post_init__(self) -> None:
        self.caches = self.caches or self.make()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def reset(self) -> None:
        self.caches, self.tokens, self.relayed = self.make(), b"", ("", 0)

    def keep(self, ctx: bytes) -> None:
        """Hold the caches for ctx: keep the positions ctx shares with the bytes they were computed from
        (each position depends only on those before it) and drop the rest, e.g. refused drafts."""
        shared = min(len(self.tokens), len(ctx))
        same = next((i for i in range(shared) if self.tokens[i] != ctx[i]), shared)
        if same < len(self.tokens):
            for cache in self.caches:
                cache.truncate(same)
            self.relayed = (self.relayed[0], min(self.relayed[1], same))
        self.tokens = ctx


class SessionCache:
    """Sessions of a serving node, bounded and expiring.

    Least recently used sessions go first when the bytes held pass `max_bytes`; a session unused
    for `ttl` seconds is dropped at the next access.
    """

    def __init__(self, max_bytes: int, ttl: float) -> None:
        self.max_bytes, self.ttl = max_bytes, ttl
        self._sessions: dict[str, Session] = {}
        # hops of different sessions run in worker threads at once, and the status reads it too
        self._lock = threading.RLock()

    def get(self, session: str, make: Callable[[], list]) -> Session:
        """The session's state; a new one holds the caches `make` returns."""
        with self._lock:
            now = time.monotonic()
            for key in [k for k, s in self._sessions.items() if now - s.used > self.ttl]:
                del self._sessions[key]
            found = self._sessions.pop(session, None) or Session(make)
            found.used = now
            self._sessions[session] = found  # most recently used last
            while self.nbytes > self.max_bytes and len(self._sessions) > 1:
                del self._sessions[next(iter(self._sessions))]
            return found

    def drop(self, session: str) -> None:
        with self._lock:
            self._sessions.pop(session, None)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._sessions.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
