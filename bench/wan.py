"""A user-space wide-area network emulator: TCP proxies that add one-way delay and cap bandwidth.

This machine's kernel has no netem, so links are emulated in user space. A `Link` listens on one
port and forwards every connection it accepts to a target address. Each direction of each
connection is paced at the link's bandwidth (a byte leaves no earlier than the link can have
serialised it) and then delayed by the one-way delay, so a request and its reply pay the round
trip twice the delay. A bounded queue per direction keeps TCP's backpressure: a sender faster than
the link is slowed down, not buffered without limit.

Put a link in front of every node (the node listens on its own port and `--announce`s the link's
port) and every node-to-node connection crosses exactly one link, configurable per node.

    python bench/wan.py --listen 127.0.0.1:9000 --target 127.0.0.1:7400 --delay-ms 20 --mbit 50
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass

from spheroid.config import parse_addr

log = logging.getLogger("wan")

CHUNK = 16 * 1024  # bytes read at a time from a socket
QUEUE_CHUNKS = 64  # chunks in flight per direction before the sender is held back (1 MiB)


@dataclass(frozen=True)
class LinkSpec:
    delay_ms: float = 20.0  # one way
    mbit: float = 50.0  # per direction of each connection


class Link:
    """One emulated link: a TCP proxy from `listen` to `target` with delay and a bandwidth cap."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], spec: LinkSpec) -> None:
        self.listen, self.target, self.spec = listen, target, spec
        self.bytes = {"forward": 0, "backward": 0}  # forward = towards the target
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, *self.listen)

    async def close(self) -> None:
        if self._server:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError as exc:
            log.debug("link to %s: %r", self.target, exc)
            writer.close()
            self._tasks.discard(task)
            return
        try:
            await asyncio.gather(self._pump(reader, up_writer, "forward"), self._pump(up_reader, writer, "backward"))
        finally:
            for w in (writer, up_writer):
                w.close()
            self._tasks.discard(task)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str) -> None:
        """Copy src to dst: paced at the link's rate, each chunk delivered `delay` after it left."""
        loop = asyncio.get_running_loop()
        rate = self.spec.mbit * 1e6 / 8  # bytes per second
        delay = self.spec.delay_ms / 1000
        queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_CHUNKS)

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                at, data = item
                if at > loop.time():
                    await asyncio.sleep(at - loop.time())
                dst.write(data)
                await dst.drain()
            with contextlib.suppress(OSError):
                dst.write_eof()

        delivering = asyncio.create_task(deliver())
        busy_until = loop.time()
        try:
            while data := await src.read(CHUNK):
                busy_until = max(busy_until, loop.time()) + len(data) / rate  # when its last bit is on the wire
                self.bytes[direction] += len(data)
                await queue.put((busy_until + delay, data))
                if busy_until > loop.time():  # hold the sender to the link's rate
                    await asyncio.sleep(busy_until - loop.time())
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            await queue.put(None)
            with contextlib.suppress(OSError, ConnectionError):
                await delivering


class Network:
    """Links running on an event loop in a background thread, for synchronous benchmark scripts."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.links: list[Link] = []
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="wan")
        self._thread.start()

    def add(self, listen: tuple[str, int], target: tuple[str, int], spec: LinkSpec) -> Link:
        link = Link(listen, target, spec)
        asyncio.run_coroutine_threadsafe(link.start(), self.loop).result(timeout=10)
        self.links.append(link)
        return link

    def close(self) -> None:
        async def close_all() -> None:
            await asyncio.gather(*(link.close() for link in self.links))

        asyncio.run_coroutine_threadsafe(close_all(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept on")
    parser.add_argument("--target", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", type=float, default=LinkSpec.delay_ms, help="one-way delay")
    parser.add_argument("--mbit", type=float, default=LinkSpec.mbit, help="bandwidth per direction, Mbit/s")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    async def run() -> None:
        link = Link(parse_addr(args.listen), parse_addr(args.target), LinkSpec(args.delay_ms, args.mbit))
        await link.start()
        log.info("link %s -> %s: %.1f ms one way, %.1f Mbit/s", args.listen, args.target, args.delay_ms, args.mbit)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
