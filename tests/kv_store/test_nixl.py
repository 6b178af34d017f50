"""The nixl data path's own guarantees: a store killed mid-READ, a client that gives a put or a
load up, bad NIXL requests, mixed tcp/nixl peers, and the registered memory's slots."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import torch
from waiting import wait_until

from pdserve.kv_store import nixl as store_nixl
from pdserve.kv_store.arena import Arena
from pdserve.kv_store.client import StoreClient
from pdserve.kv_store.protocol import (
    Commit,
    GetStats,
    NixlPut,
    PutRead,
    StatsReply,
    StoreError,
    recv_reply,
    send_msg,
)
from pdserve.kv_store.protocol import Error as ErrorReply
from pdserve.kv_transfer.nixl_agent import NixlAgent
from pdserve.kv_transfer.wire import client_handshake

from .helpers import NIXL, make_caches, make_chain, make_layout
from .test_process import LAYOUT, StoreProcess

pytestmark = pytest.mark.parametrize("transport", [NIXL])


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch):
    monkeypatch.delenv("PDSERVE_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_SECRET_FILE", raising=False)


def _put(c: StoreClient, chain, ids) -> None:
    ticket = c.put(chain.hashes, chain.tokens, ids)
    assert ticket.wait(10) and ticket.ok, ticket.error


@pytest.mark.slow
def test_a_store_killed_mid_read_means_computing(tmp_path, transport, monkeypatch):
    store = StoreProcess(tmp_path, transport)
    src, dst = make_caches(LAYOUT, 8, seed=3), make_caches(LAYOUT, 8, seed=None)
    chain = make_chain(4)
    try:
        writer = StoreClient(store.endpoint, LAYOUT, *src)
        _put(writer, chain, [0, 1, 2, 3])
        writer.close()
        reader = StoreClient(store.endpoint, LAYOUT, *dst, timeout_s=3.0)
        real_read = store_nixl.NixlStoreClient.read

        def kill_then_read(self, addrs, ids, timeout_s):
            store.proc.kill()  # the store told us where the blocks are, then died
            store.proc.wait(10)
            return real_read(self, addrs, ids, timeout_s)

        monkeypatch.setattr(store_nixl.NixlStoreClient, "read", kill_then_read)
        t0 = time.monotonic()
        assert reader.load(chain.hashes, [4, 5, 6, 7], token_ids_per_block=chain.tokens) == 0
        assert time.monotonic() - t0 < 5 and "KV store load failed" in reader.last_error
        assert "NIXL" in reader.last_error  # the READ itself failed: the store was gone
        monkeypatch.undo()
        assert reader.lookup(chain.hashes) == 0 and "not retried" in reader.last_error
        assert reader.stats() is None  # every later call fails fast; nothing raised
        reader.close()
    finally:
        store.stop()


def test_a_put_the_client_gave_up_is_never_stored(serve, client, transport, monkeypatch):
    layout = make_layout()
    served = serve(layout)
    writer = client(served.server.endpoint, layout, *make_caches(layout, 4, seed=1))
    chain = make_chain(3)

    def give_up_before_commit(self, sock, metas, sources, timeout_s, reply):
        send_msg(sock, NixlPut(metas, list(sources), [0] * len(metas)))
        store_nixl.wait_readable(sock, self.agent, timeout_s)
        recv_reply(sock, store_nixl.PutRead)  # the store has READ them ...
        raise TimeoutError("gave up")  # ... but we never commit: the blocks may change now

    monkeypatch.setattr(store_nixl.NixlStoreClient, "put", give_up_before_commit)
    ticket = writer.put(chain.hashes, chain.tokens, [0, 1, 2])
    assert ticket.wait(10) and not ticket.ok and "gave up" in ticket.error
    monkeypatch.undo()
    arena = served.server.nixl.arena
    wait_until(lambda: arena.live_slots == 0, 5, "the store to drop the READ's buffers")
    s = served.store.stats()
    assert s.blocks_put == 0 and s.dram_blocks == 0 and s.pinned_blocks == 0
    _put(writer, chain, [0, 1, 2])  # the next put goes through on a new connection
    assert served.store.stats().blocks_put == 3


def test_a_load_the_client_gave_up_releases_the_stores_pins(serve, client, transport, monkeypatch):
    layout = make_layout()
    served = serve(layout, dram_blocks=0, ssd_blocks=8)  # served from copies of SSD files
    chain = make_chain(3)
    _put(client(served.server.endpoint, layout, *make_caches(layout, 4, seed=2)), chain, [0, 1, 2])
    reader = client(served.server.endpoint, layout, *make_caches(layout, 4, seed=None))
    seen = []

    def stall(self, addrs, ids, timeout_s):
        seen.append(served.store.stats().pinned_blocks)  # pinned while we would READ
        raise TimeoutError("NIXL READ took too long")

    monkeypatch.setattr(store_nixl.NixlStoreClient, "read", stall)
    assert reader.load(chain.hashes, [0, 1, 2]) == 0 and "took too long" in reader.last_error
    assert seen == [3]
    wait_until(lambda: served.store.stats().pinned_blocks == 0, 5, "the store to unpin")
    arena = served.server.nixl.arena
    wait_until(lambda: arena.live_slots == 0, 5, "the store to drop its copies of SSD reads")
    monkeypatch.undo()
    assert reader.load(chain.hashes, [0, 1, 2], token_ids_per_block=chain.tokens) == 3


def test_tcp_clients_are_served_and_nixl_clients_of_a_tcp_store_hear_why_not(
    serve, client, transport
):
    layout = make_layout()
    src, dst = make_caches(layout, 4, seed=5), make_caches(layout, 4, seed=None)
    chain = make_chain(2)
    nixl_store = serve(layout).server.endpoint
    _put(client(nixl_store.replace("nixl://", "tcp://"), layout, *src), chain, [0, 1])
    assert client(nixl_store, layout, *dst).load(chain.hashes, [2, 3]) == 2
    assert torch.equal(dst[0][0][[2, 3]], src[0][0][[0, 1]])
    tcp_store = serve(layout, transport="tcp").server.endpoint
    c = client(tcp_store.replace("tcp://", "nixl://"), layout, *src)
    assert c.lookup(chain.hashes) == 0 and "does not serve NIXL" in c.last_error
    ticket = c.put(chain.hashes, chain.tokens, [0, 1])
    assert ticket.wait(5) and "does not serve NIXL" in ticket.error


def test_evicted_copies_are_read_from_registered_memory(serve, client, transport, monkeypatch):
    layout = make_layout()
    served = serve(layout)
    src, dst = make_caches(layout, 4, seed=6), make_caches(layout, 4, seed=None)
    c = client(served.server.endpoint, layout, *src)
    inline = []
    monkeypatch.setattr("pdserve.kv_store.client.send_buffers", lambda s, b: inline.append(b))
    copy = c.snapshot(2)
    assert isinstance(copy, memoryview) and c._nixl.arena.address(copy) is not None
    chain = make_chain(1)
    ticket = c.put_copies(chain.metas(), [copy])
    assert ticket.wait(10) and ticket.ok and ticket.stored == 1 and inline == []
    monkeypatch.undo()
    other = make_chain(1, first_token=900)  # a copy outside registered memory goes inline
    ticket = c.put_copies(other.metas(), [bytearray(c.snapshot(3))])
    assert ticket.wait(10) and ticket.ok and ticket.stored == 1
    reader = client(served.server.endpoint, layout, *dst)
    assert reader.load(chain.hashes, [0]) == 1 and reader.load(other.hashes, [1]) == 1
    for side in range(2):
        assert torch.equal(dst[side][1][[0, 1]], src[side][1][[2, 3]])


def _raw(endpoint: str, layout, extra: bytes) -> socket.socket:
    host, port = endpoint.split("://")[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    client_handshake(sock, layout, None, extra)
    return sock


@pytest.mark.parametrize(
    "request_",
    [
        NixlPut(make_chain(1).metas(), [10**6], [0]),  # outside the client's cache
        NixlPut(make_chain(1).metas(), [0, 1], [0]),  # lists of different lengths
        Commit(),  # nothing was READ
    ],
    ids=["block-id", "lengths", "commit"],
)
def test_bad_nixl_requests_drop_the_client_and_the_store_keeps_serving(
    serve, client, transport, request_
):
    layout = make_layout()
    served = serve(layout)
    good = client(served.server.endpoint, layout, *make_caches(layout, 4))
    for extra in (good._nixl.hello, b""):  # a NIXL client, and one without an agent
        sock = _raw(served.server.endpoint, layout, extra)
        send_msg(sock, request_)
        with pytest.raises(StoreError, match="refused the request"):
            recv_reply(sock, ErrorReply)
        assert sock.recv(1) == b""  # and it closed the connection
        sock.close()
    chain = make_chain(2)
    _put(good, chain, [0, 1])
    assert good.load(chain.hashes, [2, 3]) == 2 and good.last_error is None


def test_a_put_whose_read_times_out_is_answered_and_the_connection_serves_on(
    serve, client, transport, monkeypatch
):
    layout = make_layout()
    served = serve(layout)
    writer = client(served.server.endpoint, layout, *make_caches(layout, 4, seed=9))
    chain = make_chain(2)

    def stalled(*args, **kwargs):
        raise TimeoutError("NIXL READ from the client took over 30 s")

    monkeypatch.setattr(served.server.nixl.agent, "read", stalled)
    sock = _raw(served.server.endpoint, layout, writer._nixl.hello)
    send_msg(sock, NixlPut(chain.metas(), [0, 1], [0, 0]))
    reply = recv_reply(sock, PutRead)
    assert reply.read == 0 and "took over 30 s" in reply.error
    arena = served.server.nixl.arena
    wait_until(lambda: arena.live_slots == 0, 5, "the store to free the READ's buffers")
    send_msg(sock, GetStats())  # the same connection serves the next request
    assert recv_reply(sock, StatsReply).stats.blocks_put == 0
    sock.close()
    ticket = writer.put(chain.hashes, chain.tokens, [0, 1])  # the client hears why
    assert ticket.wait(10) and not ticket.ok and "took over 30 s" in ticket.error
    monkeypatch.undo()
    _put(writer, chain, [0, 1])
    assert served.store.stats().blocks_put == 2


def test_arena_slots_free_themselves_and_empty_chunks_serve_any_size(transport):
    agent = NixlAgent("test", [], progress_thread=False)
    try:
        arena = Arena(agent, capacity=2 * 4096, chunk_bytes=4096)
        a = [arena.alloc(1000) for _ in range(4)]  # 4 per chunk: the first chunk
        b = arena.alloc(3000)  # another size: the second chunk
        assert all(s is not None for s in [*a, b]) and arena.alloc(1000) is None
        assert arena.alloc(5000) is None and arena.alloc(3000) is None  # no room, or too large
        a[0][:] = b"x" * 1000
        tail = a[0][500:]  # a view keeps its slot alive
        del a[0]
        assert arena.alloc(1000) is None and bytes(tail[:3]) == b"xxx"
        del tail
        again = arena.alloc(1000)
        assert again is not None and arena.address(again) is not None
        del a, again  # the first chunk is empty now: any size may take it
        big = arena.alloc(4096)
        assert big is not None and arena.live_slots == 2
        assert arena.address(bytearray(10)) is None
        assert arena.address(np.frombuffer(big, np.uint8)[16:]) == arena.address(big) + 16
    finally:
        agent.close()


def test_registered_memory_full_falls_back_to_plain_memory(serve, client, transport):
    layout = make_layout()
    served = serve(layout)
    arena = served.server.nixl.arena
    hog = []
    while (slot := arena.alloc(arena.chunk_bytes)) is not None:
        hog.append(slot)
    src, dst = make_caches(layout, 4, seed=8), make_caches(layout, 4, seed=None)
    chain = make_chain(2)
    writer = client(served.server.endpoint, layout, *src)
    ticket = writer.put(chain.hashes, chain.tokens, [0, 1])  # nowhere to READ into
    assert ticket.wait(10) and "registered memory is full" in ticket.error
    inline = client(served.server.endpoint.replace("nixl://", "tcp://"), layout, *src)
    _put(inline, chain, [0, 1])  # a tcp put lands in plain memory
    reader = client(served.server.endpoint, layout, *dst)
    assert reader.load(chain.hashes, [2, 3]) == 0  # not servable by NIXL: computed instead
    del hog
    assert reader.load(chain.hashes, [2, 3]) == 2  # copied into registered memory to serve
    assert torch.equal(dst[1][2][[2, 3]], src[1][2][[0, 1]])


def _agents_with(local: np.ndarray, remote: np.ndarray):
    """A reading agent with `local` registered, a peer with `remote`; (reader, peer, name)."""
    reader, peer = NixlAgent("reader", [], False), NixlAgent("peer", [], progress_thread=True)
    reader.register(local.ctypes.data, local.nbytes)
    peer.register(remote.ctypes.data, remote.nbytes)
    return reader, peer, reader.add_peer(peer.metadata())


def _rows(a: np.ndarray, start: int, nbytes: int) -> np.ndarray:
    return np.array([[a.ctypes.data + start, nbytes, 0]], dtype=np.uint64)


def test_a_read_given_up_writes_nothing_afterwards(transport, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")  # not shared memory, which READs in one synchronous go
    size = 256 << 20  # large enough to be in flight when a zero timeout gives it up
    local, remote = np.zeros(size + 4096, np.uint8), np.full(size + 4096, 7, np.uint8)
    reader, peer, name = _agents_with(local, remote)
    try:
        with pytest.raises(TimeoutError, match="took over 0 s"):
            reader.read(_rows(local, 0, size), _rows(remote, 0, size), name, timeout_s=0)
        local[:size] = 1  # the caller reuses the destination once read() has given up
        # another READ drives the same UCX worker: a READ left running would complete now
        reader.read(_rows(local, size, 4096), _rows(remote, size, 4096), name)
        # What is under test is that nothing lands; there is no event to wait for, so give a
        # READ wrongly left running a fixed window to complete before looking.
        time.sleep(0.2)
        reader.progress()
        assert (local[size:] == 7).all()  # the agent still reads
        assert (local[:size] == 1).all(), "bytes of the given-up READ landed afterwards"
    finally:
        reader.close()
        peer.close()
