"""The protocol's conversation on plain bytes: the handshake of version 2, without sockets."""

import os

import msgpack
import pytest

from spheroid.wire import ProtocolError, encode
from spheroid.wire.messages import VERSION, Error, Ping, Probe, Status, Update
from spheroid.wire.session import HANDSHAKE_MAX_FRAME, Arrived, Opened, Refused, Session, State

SECRET = b"a swarm secret"


def me(**fields) -> dict:
    return {"node": os.urandom(16).hex(), "addr": "", "role": "worker", "blocks": [0], "boot": os.urandom(8),
            **fields}


def pair(dialler_secret=SECRET, acceptor_secret=SECRET) -> tuple[Session, Session]:
    return (Session(me(), dialler=True, swarm="s", secret=dialler_secret),
            Session(me(), dialler=False, swarm="s", secret=acceptor_secret))


def frames(data: bytes) -> list[dict]:
    """The messages in a run of frames."""
    out, pos = [], 0
    while pos < len(data):
        n = int.from_bytes(data[pos : pos + 4], "big")
        out.append(msgpack.unpackb(data[pos + 4 : pos + 4 + n]))
        pos += 4 + n
    return out


def test_both_sides_open_and_the_dialler_proves_first():
    d, a = pair()
    d_hello, a_hello = d.data_to_send(), a.data_to_send()
    assert not any(isinstance(e, Opened) for e in a.receive_data(d_hello))
    assert a.data_to_send() == b""  # the acceptor proves nothing before the dialler has
    d.receive_data(a_hello)
    d_proof = d.data_to_send()
    assert [m["t"] for m in frames(d_proof)] == ["auth"] and d.state is State.AUTH
    opened = [e for e in a.receive_data(d_proof) if isinstance(e, Opened)]
    assert opened and opened[0].hello.node == d.me["node"] and a.state is State.OPEN
    a_proof = a.data_to_send()
    assert [m["t"] for m in frames(a_proof)] == ["auth"]
    assert any(isinstance(e, Opened) for e in d.receive_data(a_proof)) and d.state is State.OPEN
    # then messages flow, and their ids are the session's
    [event] = a.receive_data(d.send(Status()))
    assert isinstance(event, Arrived) and isinstance(event.message, Status) and event.message.id is not None


def test_without_a_secret_the_hellos_are_the_handshake():
    d, a = pair(None, None)
    assert any(isinstance(e, Opened) for e in a.receive_data(d.data_to_send()))
    assert any(isinstance(e, Opened) for e in d.receive_data(a.data_to_send()))


def test_a_wrong_secret_fails_at_the_acceptor_which_never_proves():
    d, a = pair(SECRET, b"another secret")
    a_hello = a.data_to_send()
    a.receive_data(d.data_to_send())
    d.receive_data(a_hello)
    with pytest.raises(ProtocolError) as err:
        a.receive_data(d.data_to_send())
    assert err.value.code == "auth_failed" and a.data_to_send() == b""
    assert frames(a.refuse(err.value))[0]["code"] == "auth_failed" and a.state is State.CLOSED


def test_a_proof_is_bound_to_its_connection_and_side():
    """Replay: a dialler's valid proof from one connection, sent on another, fails. Reflection: an
    acceptor's own side label is not the dialler's, so a proof cannot be bounced back."""
    d1, a1 = pair()
    a1.receive_data(d1.data_to_send())
    d1.receive_data(a1.data_to_send())
    recorded = d1.data_to_send()  # d1's proof, valid on connection 1
    assert any(isinstance(e, Opened) for e in a1.receive_data(recorded))
    # replay: the same hello and proof bytes to a fresh acceptor, whose nonce differs
    a2 = Session(a1.me, dialler=False, swarm="s", secret=SECRET)
    a2.data_to_send()
    hello_frame = encode({"t": "hello", "id": 1, **frames_hello(d1)})
    a2.receive_data(hello_frame)
    with pytest.raises(ProtocolError, match="another connection"):
        a2.receive_data(recorded)
    # reflection: a dialler that gets its own proof back as the acceptor's refuses it
    d3, a3 = pair()
    a3.receive_data(d3.data_to_send())
    d3.receive_data(a3.data_to_send())
    reflected = d3.data_to_send()
    with pytest.raises(ProtocolError) as err:
        d3.receive_data(reflected)
    assert err.value.code == "auth_failed"


def frames_hello(session: Session) -> dict:
    """The hello a session sent, as fields (to send the same again)."""
    hello = msgpack.unpackb(session._hellos["mine"])
    return {k: v for k, v in hello.items() if k not in ("t", "id")}


@pytest.mark.parametrize("change, code", [({"version": 1}, "version"), ({"swarm": "other"}, "swarm"),
                                          ({"auth": False}, "auth_required"), ({"node": "NOT-HEX"}, "handshake"),
                                          ({"nonce": b"short"}, "handshake"), ({"blocks": ["0"]}, "handshake"),
                                          ({"serves": [-1]}, "handshake")])
def test_a_bad_hello_is_refused_with_its_code(change, code):
    a = Session(me(), dialler=False, swarm="s", secret=SECRET)
    hello = {"t": "hello", "id": 1, "version": VERSION, "swarm": "s", **me(), "nonce": os.urandom(16), "auth": True,
             **change}
    with pytest.raises(ProtocolError) as err:
        a.receive_data(encode(hello))
    assert err.value.code == code
    if code == "version":
        assert "version 1" in err.value.message and "upgrade" in err.value.message


def test_only_hello_and_auth_before_the_handshake_and_small_frames_only():
    a = Session(me(), dialler=False, swarm="s", secret=None)
    with pytest.raises(ProtocolError, match="expected hello"):
        a.receive_data(encode({"t": "status", "id": 1}))
    b = Session(me(), dialler=False, swarm="s", secret=None)
    with pytest.raises(ProtocolError) as err:  # a frame header claiming more than a hello can need
        b.receive_data((HANDSHAKE_MAX_FRAME + 1).to_bytes(4, "big"))
    assert err.value.code == "too_large"
    c = Session(me(), dialler=True, swarm="s", secret=None)
    with pytest.raises(ValueError, match="while the session is hello"):
        c.send(Status())


def test_a_large_frame_right_behind_the_hello_is_read_with_the_open_limit():
    d, a = pair(None, None)
    a.receive_data(d.data_to_send())
    big = encode({"t": "error", "id": 9, "code": "x", "message": "m" * 60_000} | {"pad": b"p" * 200_000})
    events = d.receive_data(a.data_to_send() + big)
    assert isinstance(events[-1], Arrived) and isinstance(events[-1].message, Error)


def test_a_refusal_during_the_handshake_is_an_event_and_closes():
    d, a = pair(SECRET, None)
    with pytest.raises(ProtocolError) as err:
        a.receive_data(d.data_to_send())
    [event] = [e for e in d.receive_data(a.refuse(err.value)) if isinstance(e, Refused)]
    assert event.code == "auth_required" and d.state is State.CLOSED


def test_send_checks_the_schema():
    d, a = pair(None, None)
    d.receive_data(a.data_to_send())
    with pytest.raises(ValueError, match="invalid message"):
        d.send(Ping(ts="now"))


def test_a_message_naming_a_stream_arrives_with_its_tensor():
    import torch

    from spheroid.wire import stream_frames

    d, a = pair(None, None)
    a.receive_data(d.data_to_send())
    d.receive_data(a.data_to_send())
    delta = torch.arange(10.0)
    data = b"".join(out.frame for out in stream_frames(delta, 4, d.next_id, chunk_size=16))
    data += d.send(Update(block=0, round=1, base="ab" * 32, samples=8, lo=0, hi=10, age=0.0, stream=4))
    [message] = [e.message for e in a.receive_data(data) if isinstance(e, Arrived)]
    assert isinstance(message, Update) and torch.equal(message.tensor, delta) and a.streams.held == 0
    with pytest.raises(ProtocolError, match="not complete"):  # a stream is handed over once
        a.receive_data(d.send(Probe(streams=[4])))


def test_an_update_may_carry_its_tensor_itself_read_into_a_tensor_of_its_own():
    import torch

    d, a = pair(None, None)
    a.receive_data(d.data_to_send())
    d.receive_data(a.data_to_send())
    delta = torch.randn(1 << 18)  # 1 MiB: read in place, as a socket would deliver it, in pieces
    message = Update(block=0, round=1, base="ab" * 32, samples=8, lo=0, hi=1 << 18, age=0.0, tensor=delta)
    data, events = memoryview(d.send(message)), []
    while data:
        buffer = a.get_buffer()
        n = min(len(buffer), len(data), 50_000)
        buffer[:n] = data[:n]
        events += a.buffer_updated(n)
        data = data[n:]
    [got] = [e.message for e in events if isinstance(e, Arrived)]
    assert torch.equal(got.tensor, delta) and got.stream is None
    assert got.tensor.data_ptr() % 64 == 0  # (a tensor of its own, not a view into the frame's bytes)
    got.tensor.add_(1)  # (writable)
    # a small one comes through the frame's bytes, and is a tensor of its own too
    [small] = [e.message for e in a.receive_data(d.send(message.replace(tensor=delta[:10], hi=10)))]
    assert torch.equal(small.tensor, delta[:10])
    small.tensor.add_(1)
    # a tensor's place is the message's or a stream's, never both and never neither: refused on
    # both sides
    for wrong in (message.replace(stream=4), message.replace(tensor=None)):
        with pytest.raises(ValueError, match="needs one of stream"):
            d.send(wrong)
        with pytest.raises(ProtocolError, match="needs one of stream"):
            pair_after(encode({**wrong.to_wire(), "id": 9}))


def pair_after(frame: bytes) -> list:
    """What a fresh open session makes of a frame."""
    d, a = pair(None, None)
    a.receive_data(d.data_to_send())
    return a.receive_data(frame)


def test_an_inline_tensor_read_into_place_counts_among_the_frames_in_flight():
    import torch

    from spheroid.wire.codec import Budget

    def session(frames: Budget) -> tuple[Session, Session]:
        d, a = Session(me(), dialler=True, swarm="s", secret=None), Session(me(), dialler=False, swarm="s",
                                                                               secret=None, frames=frames)
        a.receive_data(d.data_to_send())
        d.receive_data(a.data_to_send())
        return d, a

    delta = torch.randn(1 << 18)  # 1 MiB
    message = Update(block=0, round=1, base="ab" * 32, samples=8, lo=0, hi=1 << 18, age=0.0, tensor=delta)
    for limit in (8 << 20, (1 << 20) - 1):  # room for it; no room (it waits in the scratch buffer, as any frame)
        frames = Budget(limit)
        d, a = session(frames)
        data = d.send(message)
        a.receive_data(data[: len(data) // 2])
        assert frames.held == (len(delta) * 4 if limit >= len(delta) * 4 else 0)
        [got] = [e.message for e in a.receive_data(data[len(data) // 2 :])]
        assert torch.equal(got.tensor, delta) and frames.held == 0
    d, a = session(frames := Budget(8 << 20))  # a connection that ends mid-frame gives it back
    a.receive_data(d.send(message)[: 1 << 19])
    assert frames.held > 0
    a.clear()
    assert frames.held == 0


def test_an_inline_tensor_goes_where_the_receiver_lends_it_memory():
    """A receiver's `lend` sees the frame's other fields before its data and may name memory of its
    own for the tensor (a node: an averaged range's place in its next state): the data is read
    there, outside the frames in flight; whatever it declines gets a tensor of its own."""
    import torch

    from spheroid.wire.codec import Budget

    target, asked = torch.zeros(1 << 18), []

    def lend(peer: str, fields: dict, dtype: str, nbytes: int) -> memoryview | None:
        asked.append((peer, fields["t"], fields["lo"], dtype, nbytes))
        return memoryview(target.numpy()).cast("B") if fields["lo"] == 0 else None

    d = Session(me(), dialler=True, swarm="s", secret=None)
    a = Session(me(), dialler=False, swarm="s", secret=None, frames=(frames := Budget(8 << 20)), lend=lend)
    a.receive_data(d.data_to_send())
    d.receive_data(a.data_to_send())
    delta = torch.randn(1 << 18)  # 1 MiB
    message = Update(block=0, round=1, base="ab" * 32, samples=8, lo=0, hi=1 << 18, age=0.0, tensor=delta)

    def halves(message: Update) -> tuple[torch.Tensor, int]:  # (as a socket delivers a large frame: in pieces)
        data = d.send(message)
        assert a.receive_data(data[: len(data) // 2]) == []
        held = frames.held  # (mid-frame)
        [got] = [e.message for e in a.receive_data(data[len(data) // 2 :])]
        return got.tensor, held

    got, held = halves(message)
    assert torch.equal(target, delta) and got.data_ptr() == target.data_ptr() and held == 0
    other, held = halves(message.replace(lo=1, hi=(1 << 18) + 1))
    assert torch.equal(other, delta) and other.data_ptr() != target.data_ptr() and held == 1 << 20
    assert asked == [(d.me["node"], "update", 0, "float32", 1 << 20), (d.me["node"], "update", 1, "float32", 1 << 20)]


def opened_pair() -> tuple[Session, Session]:
    d, a = pair(None, None)
    a.receive_data(d.data_to_send())
    d.receive_data(a.data_to_send())
    return d, a


def test_a_reply_must_answer_an_outstanding_request_of_the_receivers():
    """PROTOCOL.md, section 2: a reply (pong aside) whose `re` names no request the receiver sent and has not
    had answered, or that has no `re`, is `unexpected`; a late one to a request its sender gave up on is not."""
    from spheroid.wire.messages import Peers, PeersReply, Pong, StatusReply

    for stray in (StatusReply(id=7, re=99, status={}), StatusReply(id=7, status={}), PeersReply(id=7, re=1, peers=[])):
        d, a = opened_pair()
        with pytest.raises(ProtocolError) as err:
            d.receive_data(a.send(stray))
        assert err.value.code == "unexpected" and "no request of this side's awaits it" in err.value.message
    d, a = opened_pair()
    [asked] = a.receive_data(d.send(Peers()))
    [answer] = d.receive_data(a.send(PeersReply(re=asked.message.id, peers=[])))  # (however late: still awaited)
    assert isinstance(answer, Arrived) and answer.message.re == asked.message.id
    with pytest.raises(ProtocolError) as err:  # answered already
        d.receive_data(a.send(PeersReply(re=asked.message.id, peers=[])))
    assert err.value.code == "unexpected"
    # a pong answers whatever it likes; an error may name any message (generate, hop, ...) and ends a request
    d, a = opened_pair()
    assert isinstance(d.receive_data(a.send(Pong(re=12345, ts=1.0)))[0].message, Pong)
    [asked] = a.receive_data(d.send(Status()))
    assert isinstance(d.receive_data(a.send(Error(re=asked.message.id, code="busy", message="later")))[0], Arrived)
    assert isinstance(d.receive_data(a.send(Error(re=4242, code="busy", message="x")))[0], Arrived)
    with pytest.raises(ProtocolError) as err:  # the error answered it
        d.receive_data(a.send(StatusReply(re=asked.message.id, status={})))
    assert err.value.code == "unexpected"


def test_a_reply_of_another_type_than_its_request_takes_is_handed_over():
    """(The receiver fails that request: Connection.request.) It answered the request, which is no longer
    outstanding."""
    from spheroid.wire.messages import Peers, StatusReply

    d, a = opened_pair()
    [asked] = a.receive_data(d.send(Peers()))
    [event] = d.receive_data(a.send(StatusReply(re=asked.message.id, status={})))
    assert isinstance(event.message, StatusReply)


def test_the_oldest_unanswered_requests_are_forgotten_beyond_a_bound(monkeypatch):
    from spheroid.wire import session as session_module
    from spheroid.wire.messages import StatusReply

    monkeypatch.setattr(session_module, "MAX_ASKED", 3)
    d, a = opened_pair()
    ids = [a.receive_data(d.send(Status()))[0].message.id for _ in range(4)]
    for i in ids[1:]:
        assert isinstance(d.receive_data(a.send(StatusReply(re=i, status={})))[0], Arrived)
    with pytest.raises(ProtocolError, match="no request"):
        d.receive_data(a.send(StatusReply(re=ids[0], status={})))


def test_a_peer_that_speaks_tls_to_a_side_without_it_is_told_apart_from_a_large_frame():
    a = Session(me(), dialler=False, swarm="s", secret=None)
    with pytest.raises(ProtocolError) as err:  # the first bytes of a TLS ClientHello
        a.receive_data(bytes.fromhex("160301020001"))
    assert err.value.code == "too_large" and "the peer speaks TLS and this side does not" in err.value.message


def test_a_secret_on_one_side_only_says_which():
    d, a = pair(SECRET, None)
    hello_d, hello_a = d.data_to_send(), a.data_to_send()
    with pytest.raises(ProtocolError, match="the peer has a swarm secret and this side has none"):
        a.receive_data(hello_d)
    with pytest.raises(ProtocolError, match="this side has a swarm secret and the peer has none"):
        d.receive_data(hello_a)
