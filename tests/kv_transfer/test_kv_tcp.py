"""tcp connector: failures, authentication, protocol limits, and a real two-process transfer."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from pdserve.kv_transfer.tcp import TcpReceiver, TcpSender
from pdserve.kv_transfer.wire import (
    MAX_FRAME_BYTES,
    LayerHeader,
    ProtocolError,
    client_handshake,
    recv_frame,
    send_frame,
)

from .helpers import make_caches, make_layout

SECRET = b"0123456789abcdef-shared"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_endpoint_fails_fast_with_a_clear_error():
    layout = make_layout()
    sender = TcpSender(layout, *make_caches(layout, 4))
    try:
        endpoint = f"tcp://127.0.0.1:{_free_port()}"  # nothing listens there
        t0 = time.monotonic()
        sender.send_layer(endpoint, "t", 0, [0], [0])
        sender.send_layer(endpoint, "t", 1, [0], [0])
        result = sender.wait("t", timeout_s=5)
        assert time.monotonic() - t0 < 2
    finally:
        sender.close()
    assert not result.ok
    assert result.error.startswith(f"sending to {endpoint} failed: cannot connect to the KV ")
    assert "Connection refused" in result.error
    assert sender.stats().failures == 1


def test_silent_endpoint_fails_within_the_timeout():
    layout = make_layout()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts in the kernel, never answers
    sender = TcpSender(layout, *make_caches(layout, 4), connect_timeout_s=0.3)
    try:
        endpoint = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        sender.send_layer(endpoint, "t", 0, [0], [0])
        result = sender.wait("t", timeout_s=3)
        assert time.monotonic() - t0 < 2
    finally:
        sender.close()
        silent.close()
    assert result.error == (
        f"sending to {endpoint} failed: the KV receiver at {endpoint} did not complete the "
        "handshake in 0.3 s"
    )


@pytest.mark.parametrize(
    ("sender_secret", "receiver_secret", "expected"),
    [
        (b"wrong-secret-0123456789", SECRET, "refused an unauthenticated sender"),
        (None, SECRET, "refused an unauthenticated sender"),
        (SECRET, None, "the receiver did not prove the shared secret"),
        (SECRET, SECRET, None),
    ],
)
def test_hmac_authentication(make_pair, sender_secret, receiver_secret, expected, monkeypatch):
    monkeypatch.delenv("PDSERVE_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_SECRET_FILE", raising=False)
    pair = make_pair("tcp", receiver={"secret": receiver_secret}, sender={"secret": sender_secret})
    pair.receiver.expect("a", [0, 1])
    pair.send_all("a", [0, 1], [0, 1])
    result = pair.sender.wait("a", timeout_s=5)
    if expected is None:
        assert result.ok and pair.landed_equal(2, [0, 1], [0, 1])
    else:
        assert not result.ok and expected in result.error
        assert "PDSERVE_SECRET" in result.error
        assert pair.untouched([0, 1])


def test_non_loopback_bind_needs_a_secret(monkeypatch, tmp_path):
    monkeypatch.delenv("PDSERVE_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_SECRET_FILE", raising=False)
    layout = make_layout()
    caches = make_caches(layout, 2)
    with pytest.raises(ValueError, match="not loopback.*PDSERVE_SECRET=.*PDSERVE_SECRET_FILE"):
        TcpReceiver(layout, *caches, host="0.0.0.0")
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    monkeypatch.setenv("PDSERVE_SECRET_FILE", str(secret_file))
    receiver = TcpReceiver(layout, *caches, host="0.0.0.0")
    assert receiver.secret == SECRET
    receiver.close()
    monkeypatch.setenv("PDSERVE_SECRET", "short")
    with pytest.raises(ValueError, match="too short"):
        TcpReceiver(layout, *caches)


def _handshaken_socket(receiver: TcpReceiver) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(receiver.endpoint.rsplit(":", 1)[1])))
    client_handshake(sock, receiver.layout, None)
    return sock


def test_oversized_or_lying_headers_drop_the_connection(make_pair):
    pair = make_pair("tcp")
    receiver = pair.receiver
    receiver.expect("a", [0])
    with _handshaken_socket(receiver) as sock:
        sock.sendall(struct.pack("!I", MAX_FRAME_BYTES + 1))
        assert sock.recv(1) == b""  # closed without reading the frame
    with _handshaken_socket(receiver) as sock:  # payload size does not match the blocks
        send_frame(sock, LayerHeader("a", 0, [0], [0], nbytes=10**9))
        assert sock.recv(1) == b""
    with _handshaken_socket(receiver) as sock:
        sock.sendall(struct.pack("!I", 3) + b"\xc1\xc1\xc1")  # not msgpack
        assert sock.recv(1) == b""
    assert pair.untouched([0])
    pair.send_all("a", [3], [0])  # the receiver still serves well-behaved senders
    assert pair.sender.wait("a", 5).ok


def test_recv_frame_refuses_oversized_frames():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!I", MAX_FRAME_BYTES + 1) + b"x" * 16)
        with pytest.raises(ProtocolError, match="exceeds the 65536-byte limit"):
            recv_frame(b, LayerHeader)
