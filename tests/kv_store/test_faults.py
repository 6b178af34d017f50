"""Failures the engine must survive: store down, stalled or cut mid-load, bad peers, auth."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest
from waiting import wait_until

from pdserve.kv_store.protocol import (
    MAX_BLOCKS,
    MAX_FRAME_BYTES,
    LoadReply,
    Query,
    recv_request,
    send_msg,
)
from pdserve.kv_transfer.wire import client_handshake, server_handshake

from .helpers import both_transports, make_caches, make_chain, make_layout

SECRET = b"0123456789abcdef-kv-store-test"


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch):
    monkeypatch.delenv("PDSERVE_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_SECRET_FILE", raising=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@both_transports
def test_store_down_every_call_fails_fast_and_clearly(client, transport):
    layout = make_layout()
    c = client(f"{transport}://127.0.0.1:{_free_port()}", layout, *make_caches(layout, 4))
    chain = make_chain(2)
    t0 = time.monotonic()
    assert c.lookup(chain.hashes) == 0
    assert "cannot connect to the KV store" in c.last_error
    assert c.load(chain.hashes, [0, 1]) == 0
    assert c.stats() is None
    ticket = c.put(chain.hashes, chain.tokens, [0, 1])
    assert ticket.wait(5) and not ticket.ok and "cannot connect" in ticket.error
    assert time.monotonic() - t0 < 2.0


class FakeStore:
    """Answers one Load with two blocks' metadata and half a layer, then stalls or hangs up."""

    def __init__(self, layout, hang_up: bool) -> None:
        self.layout, self.hang_up = layout, hang_up
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            server_handshake(conn, None, None)
            recv_request(conn)
            send_msg(conn, LoadReply(make_chain(2).metas()))
            conn.sendall(b"\0" * self.layout.block_bytes)  # one of the layer's two K blocks
            if not self.hang_up:
                self.release.wait(30)

    def close(self) -> None:
        self.release.set()
        self.thread.join(5)
        self.listener.close()


@pytest.mark.parametrize("hang_up", [False, True], ids=["stalls", "hangs-up"])
def test_store_failing_mid_load_returns_zero_within_the_timeout(client, hang_up):
    layout = make_layout()
    fake = FakeStore(layout, hang_up)
    try:
        c = client(fake.endpoint, layout, *make_caches(layout, 4))
        t0 = time.monotonic()
        assert c.load(make_chain(2).hashes, [0, 1], timeout_s=0.5) == 0
        elapsed = time.monotonic() - t0
        assert elapsed < 0.5 + 1.5  # slack for a loaded machine; a hang would take 30 s
        assert ("timed out" in c.last_error) != hang_up
        assert ("closed the connection" in c.last_error) == hang_up
    finally:
        fake.close()


def test_a_non_loopback_store_needs_a_secret(serve):
    with pytest.raises(ValueError, match="PDSERVE_SECRET"):
        serve(make_layout(), host="0.0.0.0")


@both_transports
def test_clients_must_prove_the_secret(serve, client):
    layout = make_layout()
    served = serve(layout, secret=SECRET)
    caches = make_caches(layout, 2)
    stranger = client(served.server.endpoint, layout, *caches)
    assert stranger.lookup(make_chain(1).hashes) == 0
    assert "unauthenticated" in stranger.last_error
    friend = client(served.server.endpoint, layout, *caches, secret=SECRET)
    ticket = friend.put(make_chain(1).hashes, make_chain(1).tokens, [0])
    assert ticket.wait(5) and ticket.ok
    assert friend.lookup(make_chain(1).hashes) == 1


def _raw(endpoint: str, layout) -> socket.socket:
    host, port = endpoint.removeprefix("tcp://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    client_handshake(sock, layout, None)
    return sock


@pytest.mark.parametrize(
    "frame",
    [
        (MAX_FRAME_BYTES + 1).to_bytes(4, "big"),  # oversized length: refused before reading
        (3).to_bytes(4, "big") + b"\xc1\xc1\xc1",  # not msgpack
    ],
    ids=["oversized", "malformed"],
)
def test_bad_frames_drop_the_peer_and_the_store_keeps_serving(serve, client, frame):
    layout = make_layout()
    served = serve(layout)
    sock = _raw(served.server.endpoint, layout)
    sock.sendall(frame)
    reply = sock.recv(4096)
    assert b"error" in reply and sock.recv(4096) == b""  # an Error frame, then closed
    sock.close()
    c = client(served.server.endpoint, layout, *make_caches(layout, 2))
    assert c.lookup([1]) == 0 and c.last_error is None


def test_too_many_blocks_in_one_message_are_refused(serve):
    layout = make_layout()
    served = serve(layout)
    sock = _raw(served.server.endpoint, layout)
    send_msg(sock, Query(list(range(MAX_BLOCKS + 1))))
    assert b"limit" in sock.recv(4096)
    sock.close()


def test_an_absurd_layout_is_refused(serve):
    served = serve(make_layout())
    huge = make_layout(num_layers=100_000, num_kv_heads=64, head_dim=256)  # 13 GB per block
    sock = _raw(served.server.endpoint, huge)
    assert b"exceeds" in sock.recv(4096)
    sock.close()


@both_transports
def test_metrics_endpoint_exposes_the_counters(serve, client):
    from pdserve.kv_store.metrics import serve_metrics

    layout = make_layout()
    served = serve(layout)
    c = client(served.server.endpoint, layout, *make_caches(layout, 4))
    chain = make_chain(3)
    assert c.put(chain.hashes, chain.tokens, [0, 1, 2]).wait(5)
    assert c.load(chain.hashes, [3, 2, 1]) == 3
    assert c.lookup(chain.hashes) == 3  # after the load's accounting (same connection)
    port = serve_metrics(served.store, "127.0.0.1", 0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "pdserve_kv_store_blocks_put_total 3.0" in text
    assert "pdserve_kv_store_hits_dram_total 3.0" in text
    assert "pdserve_kv_store_dram_blocks 3.0" in text
    assert "pdserve_kv_store_load_seconds_total" in text


@both_transports
def test_server_close_unblocks_idle_connections(serve, client):
    layout = make_layout()
    served = serve(layout)
    c = client(served.server.endpoint, layout, *make_caches(layout, 2))
    assert c.lookup([7]) == 0 and c.last_error is None  # an idle connection is now open
    t0 = time.monotonic()
    served.server.close()
    assert time.monotonic() - t0 < 2
    assert c.lookup([7]) == 0 and "KV store lookup failed" in c.last_error


@both_transports
def test_a_restarted_store_is_reached_on_the_first_call(serve, client, tmp_path):
    layout = make_layout()
    port = _free_port()
    served = serve(layout, dram_blocks=0, ssd_blocks=8, port=port)
    c = client(served.server.endpoint, layout, *make_caches(layout, 4))
    chain = make_chain(2)
    assert c.put(chain.hashes, chain.tokens, [0, 1]).wait(5)
    assert c.lookup(chain.hashes) == 2  # the connection is open and idle now
    served.server.close()
    serve(layout, dram_blocks=0, ssd_blocks=8, port=port)  # same directory, same port
    assert c.lookup(chain.hashes) == 2 and c.last_error is None


def test_connections_beyond_the_limit_are_turned_away_and_the_slot_comes_back(
    serve, client, tmp_path
):
    from .helpers import make_config

    layout = make_layout()
    served = serve(layout, config=make_config(tmp_path / "ssd", layout, 8, 8, max_connections=1))
    holder = _raw(served.server.endpoint, layout)  # takes the only slot
    c = client(served.server.endpoint, layout, *make_caches(layout, 2), retry_after_s=0.0)
    assert c.lookup([7]) == 0 and "KV store lookup failed" in c.last_error
    holder.close()

    def served_now() -> bool:  # the store notices the close asynchronously
        c.last_error = None
        c.lookup([7])
        return c.last_error is None

    wait_until(served_now, 5, "the freed slot to serve the next client", state=lambda: c.last_error)
