"""The wire: request frames with fds, event and op lines, and what a bad peer gets."""

import json
import os
import signal
import socket
import struct

import pytest

from preload_launcher import protocol


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_request_and_its_fds_arrive_together(pair):
    a, b = pair
    r, w = os.pipe()
    protocol.send_request(a, {"op": "step", "spec": {"args": ["python", "x.py"]}}, [r, w])
    request, fds = protocol.recv_request(b)
    assert request == {"op": "step", "spec": {"args": ["python", "x.py"]}}
    assert len(fds) == 2
    os.write(fds[1], b"through the passed fd")
    assert os.read(r, 100) == b"through the passed fd"
    for fd in (r, w, *fds):
        os.close(fd)


def test_a_frame_larger_than_one_send_arrives_whole(pair):
    a, b = pair
    env = {f"K{i}": "v" * 1000 for i in range(500)}  # ~0.5 MB: many recv() calls
    a.setblocking(True)
    import threading
    sender = threading.Thread(target=protocol.send_request,
                              args=(a, {"op": "step", "spec": {"env": env}}, []))
    sender.start()
    request, fds = protocol.recv_request(b)
    sender.join()
    assert request["spec"]["env"] == env and fds == []


@pytest.mark.parametrize("frame, message", [
    (b"\x00\x00", "short frame"),
    (struct.pack("!I", protocol.MAX_FRAME + 1), "exceeds"),
    (struct.pack("!I", 5) + b"nope!", "bad JSON"),
    (struct.pack("!I", 2) + b"[]", "not a JSON object"),
    (struct.pack("!I", 100) + b"{", "closed mid-frame"),
])
def test_bad_frames_are_protocol_errors_and_close_their_fds(pair, frame, message):
    a, b = pair
    before = set(os.listdir("/proc/self/fd"))
    r, w = os.pipe()
    socket.send_fds(a, [frame], [r])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(protocol.ProtocolError, match=message):
        protocol.recv_request(b)
    os.close(r)
    os.close(w)
    assert set(os.listdir("/proc/self/fd")) == before  # the received copy of r was closed


def test_unknown_ops_and_missing_fields_are_refused_before_sending(pair):
    a, _ = pair
    with pytest.raises(protocol.ProtocolError, match="unknown op"):
        protocol.send_request(a, {"op": "launch"}, [])
    with pytest.raises(protocol.ProtocolError, match="lacks spec"):
        protocol.send_request(a, {"op": "step"}, [])
    with pytest.raises(protocol.ProtocolError, match="lacks returncode"):
        protocol.send_event(a, "exit")
    with pytest.raises(protocol.ProtocolError, match="unknown event"):
        protocol.send_event(a, "finished", returncode=0)


def test_events_and_ops_go_through_one_reader_per_connection(pair):
    a, b = pair
    protocol.send_event(a, "started", pid=42)
    protocol.send_op(a, "signal", signum=2)
    protocol.send_event(a.fileno(), "exit", returncode=-9)  # an fd works as well as a socket
    data = b.recv(4096)
    reader = protocol.EventReader()
    # A line split across reads is kept for the next feed, not lost.
    cut = data.index(b"signum") + 3
    first = reader.feed(data[:cut])
    rest = reader.feed(data[cut:])
    assert first == [{"event": "started", "pid": 42}]
    assert rest == [{"op": "signal", "signum": 2}, {"event": "exit", "returncode": -9}]


def test_a_reader_rejects_garbage_lines():
    with pytest.raises(protocol.ProtocolError, match="bad JSON"):
        protocol.EventReader().feed(b"not json\n")
    with pytest.raises(protocol.ProtocolError, match="unknown event"):
        protocol.EventReader().feed(json.dumps({"event": "boom"}).encode() + b"\n")


def test_sending_to_a_vanished_peer_does_not_raise(pair):
    a, b = pair
    b.close()
    protocol.send_event(a, "exit", returncode=0)
    protocol.send_op(a, "signal", signum=15)


def test_sending_to_a_vanished_peer_raises_no_sigpipe(pair):
    """A stand-in relays every signal it gets over its connection: a SIGPIPE of its own making
    was relayed over the same dead connection until the recursion limit (a spawn pool's
    worker, terminated as its program had just ended, printed that traceback)."""
    a, b = pair
    b.close()
    got = []
    before = signal.signal(signal.SIGPIPE, lambda signum, frame: got.append(signum))
    try:
        protocol.send_op(a, "signal", signum=15)
        protocol.send_event(a, "exit", returncode=0)
        with pytest.raises(OSError):  # a request's sender hears of it as an error only
            protocol.send_request(a, {"op": "status"}, [])
    finally:
        signal.signal(signal.SIGPIPE, before)
    assert got == []


def test_every_event_the_package_sends_is_declared():
    import re
    import pathlib
    package = pathlib.Path(protocol.__file__).parent
    sent = set()
    for path in package.rglob("*.py"):  # every stage's folder
        sent |= set(re.findall(r'send_event\([^,]+, "(\w+)"', path.read_text()))
    assert {"exit", "exec", "started"} <= sent <= set(protocol.EVENTS), sent - set(protocol.EVENTS)
