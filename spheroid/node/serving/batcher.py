"""Continuous batching of the hops that wait at a serving node, and a rate limit on what peers'
messages can make it do."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

from .sessions import Busy


class Allowance:
    """At most `count` events in any `period` seconds: bounds what peers' messages can make a node do."""

    def __init__(self, count: int, period: float) -> None:
        self.count, self.period = count, period
        self.times: collections.deque[float] = collections.deque()

    def allow(self) -> bool:
        now = time.monotonic()
        while self.times and now - self.times[0] > self.period:
            self.times.popleft()
        if len(self.times) >= self.count:
            return False
        self.times.append(now)
        return True


class Batcher:
    """Runs a node's hops in one worker thread, a batch at a time: each batch takes every hop that
    arrived while the previous one ran (one per session, at most `max_hops` and `max_positions`
    positions in all, since a packed batch's attention mask grows with the square of its positions),
    so concurrent sessions share each layer call instead of taking turns (continuous batching). An
    idle node runs a hop at once, alone, so one session waits for nothing.

    `compute` maps a list of hops to a list of results, an exception standing for a refused hop.
    At most `max_queued` hops wait (each holds its tensor): one more is refused as busy, and its
    coordinator routes around this node or asks again after a moment, rather than the node growing
    without bound under peers that send hops faster than they run.
    """

    def __init__(self, compute: Callable[[list], list], spawn: Callable, counters: dict, max_hops: int = 32,
                 max_positions: int = 2048, max_queued: int = 128) -> None:
        self.compute, self.spawn, self.counters = compute, spawn, counters
        self.max_hops, self.max_positions, self.max_queued = max_hops, max_positions, max_queued
        self.queue: list[tuple[object, str, int, asyncio.Future]] = []
        self.busy = False

    async def run(self, hop: object, session: str, positions: int) -> object:
        """The result of `hop` (of `session`, over about `positions` positions) once its batch has run;
        raises what refused it (Busy when `max_queued` hops wait already)."""
        if len(self.queue) >= self.max_queued:
            raise Busy(f"busy: {len(self.queue)} hops wait here already")
        future = asyncio.get_running_loop().create_future()
        self.queue.append((hop, session, positions, future))
        if not self.busy:
            self.busy = True
            self.spawn(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self.queue:
                batch, sessions, positions, later = [], set(), 0, []
                for item in self.queue:  # a session's hops stay in order, one per batch
                    fits = not batch or (len(batch) < self.max_hops and positions + item[2] <= self.max_positions)
                    if fits and item[1] not in sessions:
                        batch.append(item)
                        sessions.add(item[1])
                        positions += item[2]
                    else:
                        later.append(item)
                self.queue = later
                try:
                    results = await asyncio.to_thread(self.compute, [hop for hop, _, _, _ in batch])
                except Exception as exc:  # noqa: BLE001 - whatever failed, every hop of the batch hears it
                    results = [exc] * len(batch)
                self.counters["batches"] += 1
                for (_, _, _, future), result in zip(batch, results, strict=True):
                    if future.done():  # its hop was cancelled
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self.busy = False
