"""tcp connector: failures, authentication, protocol limits, and a real two-process transfer."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch
from waiting import wait_until

from pdserve.kv_transfer.tcp import TcpReceiver, TcpSender
from pdserve.kv_transfer.wire import (
    MAX_FRAME_BYTES,
    LayerHeader,
    ProtocolError,
    client_handshake,
    recv_frame,
    send_frame,
    server_handshake,
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


def _wait_closed_by_peer(sock: socket.socket, timeout_s: float = 5.0) -> None:
    """Return once the other end has closed `sock` (end of stream, or a reset)."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the receiver kept the connection open for {timeout_s:g} s") from None


def test_recv_frame_refuses_oversized_frames():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!I", MAX_FRAME_BYTES + 1) + b"x" * 16)
        with pytest.raises(ProtocolError, match="exceeds the 65536-byte limit"):
            recv_frame(b, LayerHeader)


def test_release_cuts_a_sender_stalled_mid_layer(make_pair):
    pair = make_pair("tcp")
    receiver, bb = pair.receiver, pair.layout.block_bytes
    receiver.expect("a", [0, 1])
    with _handshaken_socket(receiver) as sock:
        send_frame(sock, LayerHeader("a", 0, [0, 1], [0, 1], nbytes=4 * bb))
        sock.sendall(b"\x01" * bb)  # K of block 0 only, then the sender goes silent
        k0 = pair.dst_k[0][0].view(torch.uint8)
        wait_until(lambda: bool((k0 == 1).all()), 5, "the receiver to write the K of block 0")
        t0 = time.monotonic()
        receiver.release("a")  # must not hang on the stalled connection
        assert 0.9 < time.monotonic() - t0 < 3  # the 1 s grace, then the connection is cut
        after_release = pair.snapshot()
        try:
            sock.sendall(b"\x02" * 3 * bb)
        except OSError:
            pass  # the receiver already closed the connection
        _wait_closed_by_peer(sock)  # after which nothing sent on it can land
    assert all(torch.equal(a, b) for a, b in zip(after_release, pair.snapshot(), strict=True))
    assert pair.untouched([0, 1], layers=[1, 2])


def _silent_receiver(layout, listener: socket.socket, stop: threading.Event) -> None:
    conn, _ = listener.accept()
    server_handshake(conn, layout, None)
    stop.wait()  # never reads a byte of payload
    conn.close()


def test_sender_wait_times_out_against_a_receiver_that_stops_reading(make_pair):
    layout = make_layout(block_size=64, num_kv_heads=4, head_dim=64)  # 64 KiB blocks
    pair = make_pair("tcp", layout, src_blocks=64, dst_blocks=64)
    listener, stop = socket.create_server(("127.0.0.1", 0)), threading.Event()
    thread = threading.Thread(target=_silent_receiver, args=(layout, listener, stop))
    thread.start()
    try:
        stuck = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        ids = list(range(64))
        for layer in range(3):  # 24 MiB: more than the socket buffers hold
            pair.sender.send_layer(stuck, "s", layer, ids, ids)
        t0 = time.monotonic()
        result = pair.sender.wait("s", timeout_s=0.5)
        assert time.monotonic() - t0 < 1.5
        assert result.error == "timed out after 0.5 s: 0 of 3 layers acknowledged by the receiver"
    finally:
        stop.set()
        thread.join()
        listener.close()
    pair.receiver.expect("ok", [5])  # the sender is not wedged: other endpoints still work
    pair.send_all("ok", [1], [5])
    assert pair.sender.wait("ok", 10).ok


def test_endpoints_of_another_backend_are_rejected_at_once(make_pair):
    pair = make_pair("tcp")
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        pair.sender.send_layer("inproc://x", "t", 0, [0], [0])


def test_a_receiver_at_its_connection_limit_says_so(make_pair):
    pair = make_pair("tcp", receiver={"max_connections": 1})
    pair.receiver.expect("t", [0])
    with _handshaken_socket(pair.receiver):  # takes the only slot
        pair.send_all("t", [0], [0], layers=[0])
        result = pair.sender.wait("t", timeout_s=5)
    assert result.error == (
        f"sending to {pair.receiver.endpoint} failed: the KV receiver is at its limit of 1 "
        "connections"
    )
    assert pair.untouched([0])
