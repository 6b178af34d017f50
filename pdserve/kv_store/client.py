"""The engine's side of the KV store: offload blocks, ask for a prefix, load it into blocks.

Over 300 lines on purpose: `StoreClient` is the one object the engine talks to, and its put and
load paths share the cache views, the nixl client, the removal log and `last_error`; split across
files, that shared state would be harder to follow. What stands on its own lives beside it:
connection.py (reconnects, deadlines), tickets.py and put_queue.py (tickets, the put thread),
layer_load.py (`LayerLoad`).

`put` is zero-copy and asynchronous: it validates the request, queues it and returns a
`PutTicket` at once; a background thread reads the blocks straight out of the engine's cache
memory and sends them. The caller must not free or overwrite those blocks until the ticket is
done (`ticket.done()`, or `flush()`): hold a reference to them until then. A full queue or a
store that is down fails the ticket at once, so the engine never waits on the store.

`lookup` and `load` run on the caller's thread on their own connection. `load` streams the
blocks layer by layer straight into the destination blocks (`recv_into` views of the cache, no
staging copy) and returns how many leading blocks landed intact. `start_load` runs the same load
on a thread of its own and reports each layer as it lands (`LayerLoad`), so that an engine can
compute layer i of the rest of a prompt while layer i + 1 of its prefix is still arriving.
Every failure (store down, timeout, corrupt or mismatching data) returns 0/None/False-like
results and sets `last_error`; only caller bugs (bad block ids, inconsistent hashes) raise
ValueError.

With a `nixl://` endpoint (a store started with the nixl transport) the same requests go on the
socket but the block bytes move by NIXL READs (nixl.py): the store READs put blocks straight
from cache memory, and a load READs the store's buffers straight into the destination blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

from pdserve.kv_store.connection import Connection, Deadline, recv_into_by
from pdserve.kv_store.interface import BlockStoreClient
from pdserve.kv_store.layer_load import LayerLoad  # noqa: F401 (store_link imports it here)
from pdserve.kv_store.protocol import (
    MAX_BLOCKS,
    BlockMeta,
    Done,
    GetStats,
    Load,
    LoadDone,
    LoadReply,
    NixlLoadReply,
    Put,
    PutReply,
    Query,
    QueryReply,
    StatsReply,
    StoreStats,
    chains,
    recv_reply,
    send_buffers,
    send_msg,
)
from pdserve.kv_store.put_queue import PutQueue
from pdserve.kv_store.tickets import PutJob, PutTicket
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.memory import (
    byte_views,
    check_block_ids,
    check_caches,
    layer_caches,
    paired_runs,
)
from pdserve.kv_transfer.wire import resolve_secret

log = logging.getLogger("pdserve.kv_store")
CHUNK = 256  # blocks per Put/Load message: bounds frames and per-message latency
_FAILURES = (OSError, ValueError)
T = TypeVar("T")  # OSError covers ConnectionError, TimeoutError, ProtocolError


class StoreClient(BlockStoreClient):
    """Talks to one store for one engine. `secret`: None reads $PDSERVE_SECRET(_FILE)."""

    def __init__(
        self,
        endpoint: str,
        layout: KVLayout,
        k_caches,
        v_caches,
        *,
        secret: bytes | None = None,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        retry_after_s: float = 1.0,
        max_queued_puts: int = 1024,
        copy_bytes: int = 64 << 20,
    ) -> None:
        self.layout = layout
        self.num_blocks = check_caches(layout, k_caches, v_caches)
        self._k, self._v = byte_views(k_caches), byte_views(v_caches)
        self.timeout_s = timeout_s
        secret = resolve_secret(secret)
        args = (endpoint, layout, secret, connect_timeout_s, retry_after_s)
        self._nixl = None  # nixl://: the NIXL agent; `copy_bytes` registered for snapshots
        if endpoint.startswith("nixl://"):
            from pdserve.kv_store.nixl import NixlStoreClient

            self._nixl = NixlStoreClient(layout, k_caches, v_caches, copy_bytes)
            n = self._nixl
            self._conn = Connection(*args, extra=n.hello, on_connect=n.attach, on_drop=n.detach)
            self._put_conn = Connection(*args, extra=n.hello)
        else:
            self._conn, self._put_conn = Connection(*args), Connection(*args)
        self._lock = threading.Lock()  # one lookup/load/stats at a time on self._conn
        self._removed: deque[int] = deque(maxlen=1 << 16)  # see drain_removed()
        self.last_error: str | None = None
        self._puts = PutQueue(self._send_put, self._put_conn.drop, max_queued_puts)

    # --- offload ----------------------------------------------------------------------------

    def put(
        self,
        block_hashes: Sequence[int],
        token_ids_per_block: Sequence[Sequence[int]],
        block_ids: Sequence[int],
        parent: int | None = None,
    ) -> PutTicket:
        """Queue blocks `block_ids` (full blocks, chained from `parent`: None for the first
        block of a sequence) for storing. Do not free or overwrite them before the ticket is
        done. Raises ValueError if the hashes do not chain over the token ids."""
        metas = self._metas(block_hashes, token_ids_per_block, parent)
        check_block_ids(list(block_ids), self.num_blocks, "put")
        if len(block_ids) != len(metas):
            raise ValueError(f"{len(block_ids)} block ids for {len(metas)} block hashes")
        ticket = self._puts.open()
        return self._puts.submit(PutJob(metas, list(block_ids), ticket))

    def put_copies(self, blocks: Sequence[BlockMeta], payloads: Sequence[bytearray]) -> PutTicket:
        """Queue blocks whose bytes were copied out of the cache with `snapshot` (each chained
        from its own parent), so that their cache blocks could be reused at once. Raises
        ValueError if a block's hash does not match its token ids or a payload its layout."""
        self._check_copies(blocks, payloads)
        return self._puts.submit(PutJob(list(blocks), list(payloads), self._puts.open()))

    def snapshot(self, block_id: int) -> bytearray | memoryview:
        """A copy of block `block_id` (K and V of every layer, as the store keeps them: K0 V0
        K1 V1 ...) for `put_copies` (nixl: in registered memory while there is room)."""
        check_block_ids([block_id], self.num_blocks, "snapshot")
        if self._nixl is not None and (copy := self._nixl.snapshot(self._buffers(block_id))):
            return copy
        return bytearray().join(self._buffers(block_id))

    @property
    def backing_off(self) -> bool:
        """The store could not be reached a moment ago and puts fail at once for now."""
        return self._put_conn.backing_off

    def _buffers(self, source: int | bytearray) -> list:
        """What to send for one block: its copy, or its cache memory (a block id)."""
        if isinstance(source, (bytes, bytearray, memoryview)):
            return [source]
        layers = range(self.layout.num_layers)
        return [v[source] for la in layers for v in layer_caches(self._k, self._v, la)]

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every put issued so far is done (stored or failed); False on timeout."""
        return self._puts.flush(timeout_s)

    def _send_put(self, job: PutJob) -> int:
        """Send one queued put, CHUNK blocks at a time (on the put thread, `PutQueue`)."""
        return sum(
            self._put_conn.call(
                partial(
                    self._put_chunk,
                    metas=job.metas[i : i + CHUNK],
                    sources=job.sources[i : i + CHUNK],
                )  # fmt: skip
            )
            for i in range(0, len(job.metas), CHUNK)
        )

    def _put_chunk(self, sock, metas: list[BlockMeta], sources: list) -> int:
        """Send the blocks the store lacks (one query first), K0 V0 K1 V1 ... per block; with
        nixl, have the store READ those in cache or registered memory."""
        present = self._request(sock, Query([m.block_hash for m in metas]), QueryReply).present
        todo = [i for i, p in enumerate(present) if not p]
        stored = 0
        if self._nixl is not None and todo:
            pullable = [self._nixl.can_pull(sources[i]) for i in todo]
            pull = [i for i, ok in zip(todo, pullable, strict=True) if ok]
            todo = [i for i, ok in zip(todo, pullable, strict=True) if not ok]
            if pull:
                stored = self._nixl.put(sock, [metas[i] for i in pull], [sources[i] for i in pull],
                                        self.timeout_s, self._reply)  # fmt: skip
        if not todo:
            return stored
        send_msg(sock, Put([metas[i] for i in todo]))
        for i in todo:
            send_buffers(sock, self._buffers(sources[i]))
        return stored + self._reply(sock, PutReply).stored

    # --- lookup and load ------------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[int], pin_s: float = 0.0) -> int:
        """How many leading `block_hashes` the store holds (0 if it cannot be reached). With
        `pin_s` > 0 the store keeps those blocks (at most the first MAX_BLOCKS) until this
        client's next request, or `pin_s` seconds at most."""
        with self._lock:
            try:
                query = Query(list(block_hashes[:MAX_BLOCKS]), pin_s)
                reply = self._conn.call(lambda sock: self._request(sock, query, QueryReply))
            except _FAILURES as exc:
                return self._failed(f"KV store lookup failed: {exc}")
        return next((i for i, p in enumerate(reply.present) if not p), len(reply.present))

    def load(
        self,
        block_hashes: Sequence[int],
        dst_block_ids: Sequence[int],
        timeout_s: float | None = None,
        token_ids_per_block: Sequence[Sequence[int]] | None = None,
        parent: int | None = None,
        on_layer: Callable[[int], None] | None = None,
    ) -> int:
        """Load the leading stored blocks of `block_hashes` into `dst_block_ids`; return how
        many landed, verified (their token ids rehash to the requested chain from `parent`, and
        equal `token_ids_per_block` when given). Blocks [0, n) then hold the stored KV; blocks
        past n may have been partly written. 0 on any failure, within `timeout_s`.
        `on_layer(i)`: layer i of every block the store sent has landed (tcp; over nixl the
        layers land together, and only the return says so)."""
        dst = self._check_load(block_hashes, dst_block_ids)
        deadline = Deadline(self.timeout_s if timeout_s is None else timeout_s)
        landed = 0
        with self._lock:
            try:
                while landed < len(dst):
                    start, end = landed, min(landed + CHUNK, len(dst))
                    expect = self._expected(block_hashes, token_ids_per_block, parent, start, end)
                    last = on_layer if end == len(dst) else None  # layer i done: in the last chunk
                    chunk = partial(self._load_chunk, expect=expect, dst=dst[start:end],
                                    deadline=deadline, on_layer=last)  # fmt: skip
                    landed += self._conn.call(chunk)
                    if landed < end:  # the store holds no more of the prefix
                        break
            except _FAILURES as exc:
                self._failed(f"KV store load failed after {landed} blocks: {exc}")
        return landed

    @staticmethod
    def _expected(hashes, tokens, parent, start: int, end: int) -> list[tuple]:
        """(hash, parent, token ids or None) for blocks start..end-1."""
        parents = [parent if i == 0 else hashes[i - 1] for i in range(start, end)]
        toks = [None if tokens is None else list(tokens[i]) for i in range(start, end)]
        return list(zip(hashes[start:end], parents, toks, strict=True))

    def _load_chunk(self, sock, expect: list[tuple], dst: list[int], deadline: Deadline,
                    on_layer: Callable[[int], None] | None = None) -> int:  # fmt: skip
        deadline.apply(sock)
        send_msg(sock, Load([h for h, _, _ in expect]))
        reply = recv_reply(sock, LoadReply if self._nixl is None else NixlLoadReply)
        metas = reply.blocks
        if len(metas) > len(expect):
            raise ValueError(f"the store sent {len(metas)} blocks for {len(expect)} asked")
        good = next((i for i, m in enumerate(metas) if not _matches(m, *expect[i])), len(metas))
        if good < len(metas):
            self.last_error = f"KV store block {metas[good].block_hash} failed verification"
            log.warning("%s; loading only the %d blocks before it", self.last_error, good)
        if isinstance(reply, NixlLoadReply):  # READ the verified blocks, then let the store go
            if len(reply.addrs) != len(metas):
                raise ValueError(f"the store sent {len(reply.addrs)} addresses for {len(metas)}")
            self._nixl.read(reply.addrs[:good], dst[:good], deadline.at - time.monotonic())
            deadline.apply(sock)
            send_msg(sock, LoadDone())
            self._reply(sock, Done)
            return good
        runs = paired_runs(range(good), dst[:good])
        bb = self.layout.block_bytes
        for layer in range(self.layout.num_layers):
            for views in layer_caches(self._k, self._v, layer):  # K, V or the latent
                for run in runs:
                    span = memoryview(views[run.dst : run.dst + run.count]).cast("B")
                    recv_into_by(sock, span, deadline)
                if len(metas) > good:  # the unverified tail: read and drop
                    recv_into_by(sock, memoryview(bytearray((len(metas) - good) * bb)), deadline)
            if on_layer is not None:
                on_layer(layer)
        return good

    # --- misc -------------------------------------------------------------------------------

    def stats(self) -> StoreStats | None:
        """The store's counters, or None if it cannot be reached."""
        with self._lock:
            try:
                return self._conn.call(lambda s: self._request(s, GetStats(), StatsReply)).stats
            except _FAILURES as exc:
                self._failed(f"KV store stats failed: {exc}")
                return None

    def _request(self, sock, msg, kind: type[T]) -> T:
        sock.settimeout(self.timeout_s)
        send_msg(sock, msg)
        return self._reply(sock, kind)

    def _reply(self, sock, kind: type[T]) -> T:
        reply = recv_reply(sock, kind)
        self._removed.extend(getattr(reply, "removed", ()))
        return reply

    def drain_removed(self) -> list[int]:
        """Block hashes the store reported gone (evicted or dropped) since the last call, in
        the order it reported them. The store tells each connection only of removals after it
        opened; an undrained backlog keeps the newest 65,536."""
        return [self._removed.popleft() for _ in range(len(self._removed))]

    def _failed(self, reason: str) -> int:
        """Record a failure (the connection is dropped: its stream position is unknown)."""
        self._conn.drop()
        self.last_error = reason
        log.warning("%s", reason)
        return 0

    def close(self) -> None:
        """Stop the put thread (queued puts fail, the one being sent finishes or fails within
        `timeout_s`), close the connections. Later puts fail at once."""
        self._puts.close(join_timeout_s=self.timeout_s + 1)
        self._put_conn.drop()
        with self._lock:
            self._conn.drop()
            if self._nixl is not None:
                self._nixl.close()


def _matches(meta: BlockMeta, block_hash: int, parent: int | None, tokens) -> bool:
    return (
        meta.block_hash == block_hash
        and meta.parent == parent
        and chains(meta)
        and (tokens is None or meta.token_ids == tokens)
    )
