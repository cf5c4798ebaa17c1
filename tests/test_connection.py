"""The asyncio connection over a real socket pair: a tensor streamed with the message that names it,
and every frame counted on both sides."""

import asyncio
import socket
import time

import pytest
import torch

from spheroid.config import NodeConfig
from spheroid.node.accounting import Traffic
from spheroid.node.connection import Connection, PeerGone
from spheroid.node.node import open_session
from spheroid.wire import ProtocolError, encode
from spheroid.wire.messages import Peers, PeersReply, Pong, Probe, Update
from spheroid.wire.streams import RAW_CHUNK_BYTES, stream_frames

ME = {"addr": "127.0.0.1:1", "role": "worker", "blocks": [0], "boot": b"12345678"}


async def connected_pair() -> tuple[Connection, Connection, list]:
    """Two open connections over a socket pair (the second dialled), and what to close."""
    a, b = socket.socketpair()
    loop = asyncio.get_running_loop()
    pair = []
    for sock, name, dialler in ((a, "ab", False), (b, "cd", True)):
        session = open_session({**ME, "node": name * 16}, NodeConfig(), None, dialler, 1 << 26)
        _, conn = await loop.connect_accepted_socket(lambda s=session: Connection(Traffic(), s, timeout=10.0), sock)
        pair.append(conn)
    await asyncio.gather(*(c.open() for c in pair))
    return pair[0], pair[1], [a, b]


@pytest.mark.parametrize("numel", [0, 1000, RAW_CHUNK_BYTES // 4, (5 << 20) // 4])
def test_a_tensor_and_the_message_naming_it_arrive_together_and_every_frame_is_counted(numel):
    """Up to a raw chunk's size the tensor travels in the message (one frame, its data read into a
    tensor of its own); larger, as a stream of chunks (2 MiB each) that the message names."""
    async def scenario():
        receiver, sender, socks = await connected_pair()
        try:
            serving = asyncio.create_task(receiver.recv())
            x = torch.randn(numel)
            message = Update(block=0, round=3, base="ab" * 32, samples=8, lo=0, hi=numel, age=0.5, stream=0)
            stream = await sender.send_tensor(x, then=message)
            got = await asyncio.wait_for(serving, 10)
            return x, stream, got, sender.traffic.by_type(), receiver.traffic.by_type()
        finally:
            for conn in (receiver, sender):
                await conn.close()
            for sock in socks:
                sock.close()

    x, stream, got, sent, received = asyncio.run(scenario())
    assert got.t == "update" and got.stream == stream and got.round == 3 and torch.equal(got.tensor, x)
    inline = numel * 4 <= RAW_CHUNK_BYTES
    assert (stream is None) == inline
    got.tensor.add_(1)  # (its own memory, writable)
    chunks = -(-numel * 4 // RAW_CHUNK_BYTES)
    for counts, direction in ((sent, "sent"), (received, "received")):
        frames = {kind: c["frames"] for kind, c in counts[direction].items() if kind.startswith(("stream", "update"))}
        assert frames == ({"update": 1} if inline else {"stream_begin": 1, "update": 1, "stream_chunk": chunks})
        assert counts[direction].get("stream_chunk", {"raw_bytes": 0})["raw_bytes"] == (0 if inline else numel * 4)
    assert sent["sent"]["update"]["wire_bytes"] == received["received"]["update"]["wire_bytes"]


def test_a_bad_frame_behind_stream_frames_in_one_read_is_refused_at_once():
    """The reader is not woken for stream frames, but it is for the error that follows them."""

    async def scenario():
        receiver, sender, socks = await connected_pair()
        try:
            begin = encode({"t": "stream_begin", "id": 50, "stream": 7, "dtype": "float32", "shape": [4],
                            "chunks": 1, "chunk_elems": 4})
            wrong_seq = encode({"t": "stream_chunk", "id": 51, "stream": 7, "seq": 3, "data": torch.zeros(4)})
            sender.transport.write(begin + wrong_seq)  # (in one read: a frame only counted, then the bad one)
            start = time.monotonic()
            with pytest.raises(ProtocolError, match="chunk 3 arrived, 0 expected"):
                await receiver.recv()
            return time.monotonic() - start
        finally:
            for conn in (receiver, sender):
                await conn.close()
            for sock in socks:
                sock.close()

    assert asyncio.run(scenario()) < 5.0  # (not the connection's 10 s timeout)


def test_a_tensor_and_message_sent_on_a_closed_connection_say_the_peer_is_gone():
    async def scenario():
        receiver, sender, socks = await connected_pair()
        message = Update(block=0, round=3, base="ab" * 32, samples=8, lo=0, hi=10, age=0.5, stream=0)
        with pytest.raises(ValueError, match="names no single stream"):
            await sender.send_tensor(torch.randn(10), then=Probe(streams=[]))
        await sender.close()  # (its chunk is encoded in a thread, then the message cannot go)
        with pytest.raises(PeerGone):
            await sender.send_tensor(torch.randn(10), "int8", then=message)
        await receiver.close()
        for sock in socks:
            sock.close()

    asyncio.run(scenario())


def test_a_reply_of_another_type_than_the_request_takes_fails_the_request():
    """A peer answering `peers` with a `pong` under the request's id: the request fails as if the
    peer had gone (callers read `peers` off the reply), and the connection keeps serving."""
    async def scenario():
        asker, answerer, socks = await connected_pair()
        reading = asyncio.create_task(asker.serve(lambda conn, msg: asyncio.sleep(0), idle_timeout=10))
        try:
            asking = asyncio.create_task(asker.request(Peers()))
            request = await answerer.recv()
            await answerer.send(Pong(ts=0.0, re=request.id))
            with pytest.raises(PeerGone, match="answered peers with a pong message, not peers_reply"):
                await asking
            asking = asyncio.create_task(asker.request(Peers()))
            request = await answerer.recv()
            await answerer.send(PeersReply(peers=[], re=request.id))
            return await asking
        finally:
            for conn in (asker, answerer):
                await conn.close()
            reading.cancel()
            for sock in socks:
                sock.close()

    assert asyncio.run(scenario()).peers == []


def test_a_stream_that_stops_arriving_is_found_stalled_after_three_timeouts():
    """A peer announces a stream and sends nothing more (its bytes stay reserved): the connection
    says so once three timeouts passed without a frame of it, and not while frames come; so too for
    a stream complete but never named by a message."""
    async def scenario():
        receiver, sender, socks = await connected_pair()
        try:
            ids = iter(range(100, 200))
            frames = list(stream_frames(torch.zeros(3 << 20), 7, lambda: next(ids)))  # 12 MiB: 6 chunks
            streams = receiver.session.streams

            async def until(placed):  # (stream frames are read by the socket's callback: no reader needed)
                async with asyncio.timeout(10):
                    while streams.progress < placed:
                        await asyncio.sleep(0.01)

            await sender._write(frames[:2])  # the begin and one chunk
            await until(2)
            seen = [receiver.stream_stalled(t) for t in (0.0, 29.0)]
            await sender._write(frames[2:3])
            await until(3)
            seen += [receiver.stream_stalled(t) for t in (31.0, 59.0, 62.0)]
            await sender._write(frames[3:])
            await until(len(frames))
            seen += [receiver.stream_stalled(t) for t in (100.0, 131.0)]  # complete, and no message names it
            streams.take(7)
            return seen + [receiver.stream_stalled(200.0)]
        finally:
            for conn in (receiver, sender):
                await conn.close()
            for sock in socks:
                sock.close()

    # (timeout 10 s: stalled past 30 s without a frame, or complete and unnamed; none held at the end)
    assert asyncio.run(scenario()) == [False, False, False, False, True, False, True, False]


def test_tls_flags_go_together_and_a_bad_pem_names_its_files(tmp_path):
    from spheroid.node.node import ssl_contexts

    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    for flags in ({"tls_cert": str(junk)}, {"tls_key": str(junk)}, {"tls_ca": str(junk)}):
        with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
            NodeConfig(**flags)
    with pytest.raises(ValueError, match=f"cannot load TLS from {junk}, {junk}: .*give a PEM certificate"):
        ssl_contexts(NodeConfig(tls_cert=str(junk), tls_key=str(junk)))
