"""One client connection to the store, after its handshake: a handler per request type.

Requests are served in order. A lookup's lease (`Query.pin_s`) lasts until the connection's next
request or its end. Over nixl, a load's blocks stay pinned, their buffers alive, until the
client's LoadDone (`_Held`), and the blocks READ for a put are stored only on its Commit; the
next request, or the connection's end, gives either up.
"""

from __future__ import annotations

import socket
import time

from pdserve.kv_store.config import Key, layout_key, payload_bytes
from pdserve.kv_store.protocol import (
    MAX_REMOVED,
    Attach,
    AttachReply,
    Commit,
    Done,
    GetStats,
    Load,
    LoadDone,
    LoadReply,
    NixlLoadReply,
    NixlPut,
    Put,
    PutReply,
    Query,
    QueryReply,
    StatsReply,
    send_buffers,
    send_msg,
)
from pdserve.kv_store.store import Store
from pdserve.kv_store.tiers import Entry, Payload
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.wire import ProtocolError, recv_into_exact


class _Held:
    """Blocks a nixl load handed out: pinned, their buffers alive, until the client is done."""

    def __init__(self, store: Store, entries: list[Entry], payloads: list, requested: int):
        self.store, self.entries, self.payloads = store, entries, payloads
        self.requested, self.t0 = requested, time.perf_counter()

    def release(self, done: bool) -> None:
        if self.entries is None:
            return
        self.store.release(self.entries)
        if done:  # the client read them all
            nbytes = sum(len(p) for p in self.payloads)
            self.store.record_load(self.requested, len(self.payloads), nbytes,
                                   time.perf_counter() - self.t0)  # fmt: skip
        self.entries, self.payloads = None, []  # type: ignore[assignment]


class Session:
    """One handshaken connection: its layout, its lease, and a handler per request type."""

    def __init__(
        self, store: Store, conn: socket.socket, layout: KVLayout, io_timeout_s: float,
        nixl=None, peer=None,
    ) -> None:  # fmt: skip
        self.store, self.conn, self.layout = store, conn, layout
        self.layout_key = layout_key(layout)
        self.lease: int | None = None
        self._prev_lease: int | None = None
        self._removal_cursor = store.removal_cursor()
        self.nixl, self.peer = nixl, peer  # the store's NixlStoreServer; the client's agent
        self.attached = False  # the client asked for the store's agent: loads go by NIXL
        self.held: _Held | None = None  # a nixl load's blocks, until the next request
        self.pending: list | None = None  # blocks READ for a put, kept only on Commit
        self.io_timeout_s = io_timeout_s

    def close(self) -> None:
        """The connection is gone: unpin what it held, drop what it did not commit."""
        self._prev_lease, self.lease = self.lease, None
        self.end_prev_lease()
        if self.held is not None:
            self.held.release(done=False)
        self.held = self.pending = None

    def keys(self, hashes: list[int]) -> list[Key]:
        return [Key(self.layout_key, h) for h in hashes]

    def handle(self, req) -> None:
        # A lookup's lease covers the window until the next request: it ends once that request
        # has pinned what it needs, and before its reply goes out (so a client that got the
        # reply observes the lease gone).
        self._prev_lease, self.lease = self.lease, None
        held, self.held = self.held, None  # a nixl load's blocks stay pinned until LoadDone ...
        pending, self.pending = self.pending, None  # ... and READ blocks unstored until Commit
        try:
            if isinstance(req, Query):
                self.query(req)
            elif isinstance(req, Put):
                self.put(req)
            elif isinstance(req, Load) and self.attached:
                self.nixl_load(req)
            elif isinstance(req, Load):
                self.load(req)
            elif isinstance(req, GetStats):
                self.end_prev_lease()
                send_msg(self.conn, StatsReply(self.store.stats()))
            else:
                self.handle_nixl(req, held, pending)
        finally:
            if held is not None:
                held.release(done=False)  # not LoadDone: the client gave the load up
            self.end_prev_lease()

    def handle_nixl(self, req, held: _Held | None, pending: list | None) -> None:
        if self.nixl is None or (self.peer is None and not isinstance(req, Attach)):
            raise ProtocolError(
                "this KV store does not serve NIXL clients (start it with --transport nixl)"
                if self.nixl is None
                else "a NIXL request from a client without a NIXL agent"
            )
        self.end_prev_lease()
        if isinstance(req, Attach):
            self.attached = True
            send_msg(self.conn, AttachReply(self.nixl.metadata))
        elif isinstance(req, NixlPut):
            self.pending, reply = self.nixl.read_put(self.layout, self.peer, req, self.io_timeout_s)
            send_msg(self.conn, reply)
        elif isinstance(req, Commit):
            if pending is None:
                raise ProtocolError("Commit without a NixlPut before it")
            stored = sum(self.store.put(Key(self.layout_key, meta.block_hash), self.layout,
                                        meta, buf) for meta, buf in pending)  # fmt: skip
            send_msg(self.conn, PutReply(stored, self.removed()))
        elif isinstance(req, LoadDone):
            if held is None:
                raise ProtocolError("LoadDone without a load before it")
            held.release(done=True)
            send_msg(self.conn, Done(self.removed()))

    def removed(self) -> list[int]:
        """Hashes of this layout that left the store since the previous reply."""
        hashes, self._removal_cursor = self.store.removed_since(
            self._removal_cursor, self.layout_key, MAX_REMOVED
        )
        return hashes

    def end_prev_lease(self) -> None:
        self.store.unpin(self._prev_lease)
        self._prev_lease = None

    def query(self, req: Query) -> None:
        keys = self.keys(req.block_hashes)
        present = self.store.contains(keys)
        if req.pin_s > 0:
            self.lease = self.store.pin_prefix(keys, req.pin_s)
        self.end_prev_lease()
        send_msg(self.conn, QueryReply(present, self.removed()))

    def put(self, req: Put) -> None:
        """Receive each block straight into the buffer the store keeps (no staging copy)."""
        self.end_prev_lease()
        stored, n = 0, payload_bytes(self.layout)
        for meta in req.blocks:
            buf = self.store.buffer(n)
            recv_into_exact(self.conn, memoryview(buf))
            stored += self.store.put(Key(self.layout_key, meta.block_hash), self.layout, meta, buf)
        send_msg(self.conn, PutReply(stored, self.removed()))

    def load(self, req: Load) -> None:
        """Pin the held prefix while reading it (SSD files are read and checksummed here), then
        send from the buffers read: eviction after the unpin cannot touch them."""
        t0 = time.perf_counter()
        entries = self.store.acquire(self.keys(req.block_hashes))
        self.end_prev_lease()
        payloads: list[Payload] = []
        try:
            for entry in entries:  # a corrupt file ends the prefix there
                if (data := self.store.read(entry)) is None:
                    break
                payloads.append(data)
        finally:
            self.store.release(entries)
        send_msg(self.conn, LoadReply([e.meta for e in entries[: len(payloads)]]))
        nbytes = self._send_layer_major(payloads)
        self.store.record_load(len(req.block_hashes), len(payloads), nbytes,
                               time.perf_counter() - t0)  # fmt: skip

    def nixl_load(self, req: Load) -> None:
        """Tell the client where the held prefix lies in registered memory; keep it pinned and
        its buffers alive until LoadDone (or the next request, or the connection's end)."""
        entries = self.store.acquire(self.keys(req.block_hashes))
        self.end_prev_lease()
        payloads, addrs = [], []
        try:
            for entry in entries:  # a corrupt file ends the prefix there, so does a full region
                data = self.store.read(entry)
                servable = None if data is None else self.nixl.servable(data)
                if servable is None:
                    break
                payloads.append(servable[0])
                addrs.append(servable[1])
        finally:
            self.store.release(entries[len(payloads) :])
        held = entries[: len(payloads)]
        self.held = _Held(self.store, held, payloads, len(req.block_hashes))
        send_msg(self.conn, NixlLoadReply([e.meta for e in held], addrs))

    def _send_layer_major(self, payloads: list[Payload]) -> int:
        """Per layer: every block's K, then every block's V (stored as K0 V0 K1 V1 ...; an MLA
        latent's as L0 L1 ...)."""
        bb, sent, n = self.layout.block_bytes, 0, self.layout.tensors
        views = [memoryview(p) for p in payloads]
        for layer in range(self.layout.num_layers):
            for part in range(n * layer, n * (layer + 1)):  # K, then V (or the latent)
                sent += send_buffers(self.conn, [v[part * bb : (part + 1) * bb] for v in views])
        return sent
