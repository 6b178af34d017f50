"""`MooncakeStoreClient`: the KV store interface of `StoreClient`, on a Mooncake Store pool.

`--kv-store mooncake://MASTER_HOST:PORT[?...]` (the parameters: `kv_store/mooncake_setup.py`)
makes a worker a client of a Mooncake Store cluster instead of one `pdserve store`: each worker
contributes DRAM to the pool, whose master places objects and evicts. The engine's side
(`StoreLink`) is unchanged: `put`, `put_copies`, `snapshot`, `lookup`, `load`, `start_load`,
`drain_removed`, `flush`, `close`, `backing_off`, `last_error`. With `metrics_port` its counters
(hits, misses, evictions seen, bytes) are Prometheus /metrics.

A block is `L` layer objects plus a verified meta object (`kv_store/mooncake_blocks.py`). A load
reads the meta objects first and verifies them, then the layers one by one, checking each
object's size; whatever fails (a silent eviction, a lease, a master or peer gone) ends the
prefix there: those blocks are a miss and are computed.

Mooncake's calls are blocking C++ calls; each runs on a thread of this client and is waited for
at most `timeout_s` (`kv_store/mooncake_calls.py`). A call past its deadline fails the operation,
and the client fails fast (no new calls) until that call returns. An abandoned call may still
write or read its buffers later, so:

* with `zero_copy=1`, a load under an engine step (`start_load`) reads each layer object into the
  sequence's new K and V blocks (zero-copy: the cache tensors are registered with the
  transfer engine, `batch_get_into_multi_buffers` scatters an object's K and V halves), after
  its meta object was read into a staging buffer and verified. Those blocks are the loading
  sequence's own, not yet in the prefix cache, so nothing else reads them; if a layer call is
  abandoned, `late_writes()` names its blocks until it returns and `StoreLink` sets them aside
  (the sequence computes into new ones);
* a synchronous `load` (a prefill worker; a decode worker's remote-prefill admission, whose
  block table a prefill worker is told to write into) and every put go through registered
  staging buffers (one copy each way) that no later call reuses while one is outstanding: a
  late write never lands in a cache block, and a late read never stores a reused block's bytes
  under a hash. (Puts: 0.3.13 has no multi-buffer upsert either.)

The master restarting empties the pool (it keeps metadata in memory); the client re-registers
by itself (Mooncake's heartbeat) and the pool refills from new offloads. Exposure: the master
and every client's transfer port accept unauthenticated connections; bind them to a private
network (docs/serving.md).

Over 300 lines on purpose: the `BlockStoreClient` interface is this one class, its put and load
paths sharing the pool, the counters and the fail-fast state; what stands alone is in
`mooncake_setup.py`, `mooncake_calls.py` and `mooncake_blocks.py`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from pdserve.kv_store.config import payload_bytes
from pdserve.kv_store.interface import BlockStoreClient
from pdserve.kv_store.mooncake_blocks import META_ROOM, PoolBlocks
from pdserve.kv_store.mooncake_calls import Buffer, Caller, PoolCounters, PoolError, serve_counters
from pdserve.kv_store.mooncake_setup import SCHEME, import_mooncake, local_address, parse_endpoint
from pdserve.kv_store.protocol import BlockMeta
from pdserve.kv_store.put_queue import PutQueue
from pdserve.kv_store.tickets import PutJob, PutTicket
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.memory import byte_views, check_block_ids, check_caches

log = logging.getLogger("pdserve.kv_store")


class MooncakeStoreClient(BlockStoreClient):
    """The `StoreClient` interface over a Mooncake Store pool (see the module docstring)."""

    def __init__(
        self,
        endpoint: str,
        layout: KVLayout,
        k_caches,
        v_caches,
        *,
        timeout_s: float = 5.0,
        max_queued_puts: int = 1024,
        store=None,
    ) -> None:
        self.master, params = parse_endpoint(endpoint)
        self.layout = layout
        self.num_blocks = check_caches(layout, k_caches, v_caches)
        self._k, self._v = byte_views(k_caches), byte_views(v_caches)
        self.timeout_s = timeout_s
        self.blocks = PoolBlocks(layout, params.get("rank", 0))
        self.layer_bytes = self.blocks.layer_bytes
        self.replicas = int(params.get("replicas", 1))
        self.prefer = params.get("prefer", "")
        buffer_bytes = int(params.get("buffer_mb", 64)) << 20
        segment_bytes = int(params.get("segment_mb", 512)) << 20
        if buffer_bytes < payload_bytes(layout):
            raise ValueError(
                f"mooncake:// buffer_mb={buffer_bytes >> 20} holds no block of "
                f"{payload_bytes(layout)} bytes: raise it"
            )
        Store, self._Replicate = import_mooncake()
        host = params.get("host") or local_address(self.master)
        self._store = store or Store()
        self._load_call, self._put_call = Caller("mooncake-load"), Caller("mooncake-put")
        try:  # bounded: a master that accepts but never answers must not hang the worker's start
            rc = self._load_call(max(30.0, timeout_s), self._store.setup, host, "P2PHANDSHAKE",
                                 segment_bytes, 16 << 20, "tcp", "", self.master)  # fmt: skip
        except PoolError as exc:
            rc = str(exc)
        if rc != 0:
            raise ConnectionError(
                f"could not join the Mooncake pool at {self.master} (setup: {rc}): is "
                "`mooncake_master` running there, with this host able to reach it?"
            )
        # staging: half for loads, half for puts; each registered with the transfer engine
        self._load_buf, self._put_buf = Buffer(buffer_bytes // 2), Buffer(buffer_bytes // 2)
        for buf in (self._load_buf, self._put_buf):
            if self._store.register_buffer(buf.ptr, buf.size) != 0:
                raise ConnectionError("Mooncake refused to register this client's buffers")
        self._into_cache = params.get("zero_copy") == "1" and self._register_cache()
        self._late: frozenset[int] = frozenset()  # blocks an abandoned zero-copy call may write
        self._lock = threading.Lock()  # one lookup/load at a time (they share _load_buf)
        self._removed: deque[int] = deque(maxlen=1 << 16)
        self.counters = PoolCounters()
        self.last_error: str | None = None
        self._backoff_until = 0.0
        self._puts = PutQueue(self._send_put, self._put_failed, max_queued_puts)
        self.metrics_port = None
        if "metrics_port" in params:  # this client's counters as Prometheus /metrics
            self.metrics_port = serve_counters(self.counters, host, int(params["metrics_port"]))

    def _register_cache(self) -> bool:
        """Register the cache tensors for zero-copy loads; False (loads staged) if refused."""
        for arr in (*self._k, *self._v):
            if self._store.register_buffer(arr.ctypes.data, arr.nbytes) != 0:
                log.warning("Mooncake refused to register the KV cache: loads are staged")
                return False
        return True

    # --- offload ----------------------------------------------------------------------------

    def put(self, block_hashes, token_ids_per_block, block_ids, parent=None) -> PutTicket:
        """As `StoreClient.put`: the blocks are copied out of the cache on the put thread."""
        metas = self._metas(block_hashes, token_ids_per_block, parent)
        check_block_ids(list(block_ids), self.num_blocks, "put")
        if len(block_ids) != len(metas):
            raise ValueError(f"{len(block_ids)} block ids for {len(metas)} block hashes")
        return self._puts.submit(PutJob(metas, list(block_ids), self._puts.open()))

    def put_copies(self, blocks: Sequence[BlockMeta], payloads) -> PutTicket:
        self._check_copies(blocks, payloads)
        return self._puts.submit(PutJob(list(blocks), list(payloads), self._puts.open()))

    def snapshot(self, block_id: int) -> bytearray:
        """A copy of block `block_id`, layer by layer (K then V), for `put_copies`."""
        check_block_ids([block_id], self.num_blocks, "snapshot")
        return bytearray().join(self._layer_bytes(block_id, la)
                                for la in range(self.layout.num_layers))  # fmt: skip

    def _layer_bytes(self, source, layer: int):
        if isinstance(source, (bytes, bytearray, memoryview)):
            lb = self.layer_bytes
            return memoryview(source)[layer * lb : (layer + 1) * lb]
        return bytes(self._k[layer][source]) + bytes(self._v[layer][source])

    @property
    def backing_off(self) -> bool:
        return time.monotonic() < self._backoff_until or self._put_call.stuck

    def flush(self, timeout_s: float | None = None) -> bool:
        return self._puts.flush(timeout_s)

    def _send_put(self, job: PutJob) -> int:
        """Store the blocks the pool lacks, as many at a time as the put buffer holds."""
        if time.monotonic() < self._backoff_until:
            raise PoolError("the Mooncake pool failed a moment ago; not retrying yet")
        meta_keys = [self._key(m.block_hash, "m") for m in job.metas]
        present = self._put_call(self.timeout_s, self._store.batch_is_exist, meta_keys)
        todo = [i for i, p in enumerate(present) if p != 1]
        per_round = max(1, self._put_buf.size // (payload_bytes(self.layout) + META_ROOM))
        stored = 0
        for r in range(0, len(todo), per_round):
            stored += self._put_round(job, todo[r : r + per_round])
        return stored

    def _put_round(self, job: PutJob, todo: list[int]) -> int:
        if self._put_call.stuck:  # it may still be reading the put buffer: leave it alone
            raise PoolError("an earlier Mooncake put has not returned yet")
        metas, sources = [job.metas[i] for i in todo], [job.sources[i] for i in todo]
        keys, ptrs, sizes = self.blocks.stage(self._put_buf, metas, sources, self._layer_bytes)
        cfg = self._Replicate()
        cfg.replica_num = self.replicas
        if self.prefer:
            cfg.preferred_segment = self.prefer
        codes = self._put_call(self.timeout_s, self._store.batch_upsert_from, keys, ptrs, sizes,
                               cfg)  # fmt: skip
        stored = sum(self.blocks.stored(codes, len(todo)))
        self.counters.put_blocks += stored
        self.counters.put_bytes += stored * payload_bytes(self.layout)
        if stored < len(todo):
            bad = next(c for c in codes if c < 0)
            log.warning("Mooncake stored %d of %d blocks (error %d)", stored, len(todo), bad)
            raise PoolError(f"Mooncake stored {stored} of {len(todo)} blocks (error {bad})")
        return stored

    def _put_failed(self) -> None:
        self.counters.failures += 1
        self.last_error = "a Mooncake put failed (see the log)"
        now = time.monotonic()
        if now >= self._backoff_until:  # a put refused for the backoff does not extend it
            self._backoff_until = now + 1.0

    # --- lookup and load ------------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[int], pin_s: float = 0.0) -> int:
        """How many leading `block_hashes` the pool holds whole (0 if it cannot be reached).
        `pin_s` is not honoured: a Mooncake read takes its own lease, a miss is computed."""
        if not block_hashes:
            return 0
        keys = []
        for h in block_hashes:
            keys += [self._key(h, "m"), *self.blocks.layer_keys(h)]
        with self._lock:
            try:
                present = self._load_call(self.timeout_s, self._store.batch_is_exist, keys)
            except PoolError as exc:
                return self._failed(f"Mooncake lookup failed: {exc}")
        per = self.layout.num_layers + 1
        n = next((i for i in range(len(block_hashes))
                  if any(p != 1 for p in present[i * per : (i + 1) * per])),
                 len(block_hashes))  # fmt: skip
        if n < len(block_hashes):
            self.counters.misses += 1
            self._removed.append(block_hashes[n])
        return n

    def load(
        self,
        block_hashes: Sequence[int],
        dst_block_ids: Sequence[int],
        timeout_s: float | None = None,
        token_ids_per_block=None,
        parent: int | None = None,
        on_layer: Callable[[int], None] | None = None,
        into_cache: bool = False,
    ) -> int:
        """As `StoreClient.load`: blocks [0, n) hold verified pool KV; 0 on any failure.
        `into_cache`: layers are read straight into the cache (see `late_writes`)."""
        dst = self._check_load(block_hashes, dst_block_ids)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        landed = 0
        with self._lock:
            try:
                staged = payload_bytes(self.layout) if not into_cache else META_ROOM
                per_round = max(1, self._load_buf.size // staged)
                while landed < len(dst):
                    end = min(landed + per_round, len(dst))
                    last = on_layer if end == len(dst) else None
                    got = self._load_round(block_hashes, token_ids_per_block, parent, dst,
                                           landed, end, deadline, last, into_cache)  # fmt: skip
                    landed += got
                    if landed < end:
                        break
            except PoolError as exc:
                self._failed(f"Mooncake load failed after {landed} blocks: {exc}")
        self.counters.hits += landed
        self.counters.load_bytes += landed * payload_bytes(self.layout)
        if landed < len(dst):
            self.counters.misses += 1
        return landed

    def _load_round(self, hashes, tokens, parent, dst, start, end, deadline, on_layer,
                    into_cache: bool) -> int:  # fmt: skip
        """Load blocks start..end-1: verify their meta objects, then layer by layer into the
        cache (through the load buffer, or straight in). Returns how many leading blocks
        landed whole."""
        good = self._verified_metas(hashes, tokens, parent, start, end, deadline)
        for layer in range(self.layout.num_layers if good else 0):
            keys = [self._key(hashes[start + j], layer) for j in range(good)]
            blocks = dst[start : start + good]
            if into_cache:
                sizes = self._layer_into_cache(deadline, layer, keys, blocks)
            else:
                sizes = self._layer_staged(deadline, layer, keys, blocks)
            whole = next((j for j, s in enumerate(sizes) if s != self.layer_bytes), good)
            if whole < good:  # evicted under us, or a peer gone: the rest is computed
                self._evicted(hashes[start + whole])
                good = whole
            if on_layer is not None:
                on_layer(layer)
            if good == 0:
                return 0
        return good

    def _verified_metas(self, hashes, tokens, parent, start, end, deadline) -> int:
        """Read the meta objects of blocks start..end-1 into the load buffer; how many leading
        ones verify (before any byte of theirs is written into the cache)."""
        n, room, buf = min(end - start, self._load_buf.size // META_ROOM), META_ROOM, self._load_buf
        keys = [self._key(hashes[i], "m") for i in range(start, start + n)]
        ptrs = [buf.ptr + j * room for j in range(n)]
        sizes = self._call(deadline, self._store.batch_get_into, keys, ptrs, [room] * n)
        good = 0
        for j, size in enumerate(sizes):
            i = start + j
            want_parent = parent if i == 0 else hashes[i - 1]
            want_tokens = None if tokens is None else list(tokens[i])
            blob = buf.view[j * room : j * room + max(size, 0)]
            if not self.blocks.meta_ok(blob, hashes[i], want_parent, want_tokens):
                break
            good += 1
        if good < n:
            self._evicted(hashes[start + good])
        return good

    def _layer_staged(self, deadline, layer: int, keys, blocks) -> list[int]:
        """Read one layer of `blocks` into the load buffer, then copy what is whole."""
        lb, half, buf = self.layer_bytes, self.layer_bytes // 2, self._load_buf
        ptrs = [buf.ptr + j * lb for j in range(len(keys))]
        sizes = self._call(deadline, self._store.batch_get_into, keys, ptrs, [lb] * len(keys))
        for j, d in enumerate(blocks):
            if sizes[j] == lb:
                self._k[layer][d] = buf.view[j * lb : j * lb + half]
                self._v[layer][d] = buf.view[j * lb + half : (j + 1) * lb]
        return sizes

    def _layer_into_cache(self, deadline, layer: int, keys, blocks) -> list[int]:
        """Read one layer of `blocks` straight into their K and V (an object's two halves)."""
        half = self.layer_bytes // 2
        k, v = self._k[layer], self._v[layer]
        ptrs = [[k.ctypes.data + d * half, v.ctypes.data + d * half] for d in blocks]
        try:
            return self._call(deadline, self._store.batch_get_into_multi_buffers, keys, ptrs,
                              [[half, half]] * len(keys))  # fmt: skip
        except PoolError:
            if self._load_call.stuck:  # it may still write into these blocks
                self._late = frozenset(blocks)
            raise

    def late_writes(self) -> frozenset[int]:
        if self._late and not self._load_call.stuck:
            self._late = frozenset()
        return self._late

    def _call(self, deadline: float, fn: Callable, *args):
        left = deadline - time.monotonic()
        if left <= 0:
            raise PoolError("the load's deadline passed")
        return self._load_call(left, fn, *args)

    def _evicted(self, block_hash: int) -> None:
        self.counters.evictions_seen += 1
        self._removed.append(block_hash)

    def _threaded_load(self, block_hashes, dst_block_ids, token_ids_per_block, parent,
                       on_layer) -> int:  # fmt: skip
        return self.load(block_hashes, dst_block_ids, None, token_ids_per_block, parent,
                         on_layer, into_cache=self._into_cache)  # fmt: skip

    # --- misc -------------------------------------------------------------------------------

    def _key(self, block_hash: int, part: int | str) -> str:
        return self.blocks.key(block_hash, part)

    def stats(self) -> dict[str, int]:
        return self.counters.as_dict()

    def drain_removed(self) -> list[int]:
        """Hashes found missing (a silent eviction, a restarted master) since the last call."""
        return [self._removed.popleft() for _ in range(len(self._removed))]

    def _failed(self, reason: str) -> int:
        self.counters.failures += 1
        if "took over" in reason:
            self.counters.timeouts += 1
        self.last_error = reason
        log.warning("%s", reason)
        return 0

    def close(self) -> None:
        self._puts.close(join_timeout_s=self.timeout_s + 1)
        for call in (self._load_call, self._put_call):
            call.close()
        if not (self._load_call.stuck or self._put_call.stuck):  # else it may still use them
            closer = threading.Thread(target=self._close_store, name="mooncake-close", daemon=True)
            closer.start()
            closer.join(self.timeout_s)  # unmounting its segment asks the master: bounded

    def _close_store(self) -> None:
        try:
            self._store.close()
        except Exception:  # closing a client of a pool that is gone
            log.debug("Mooncake close failed", exc_info=True)


def open_store_client(endpoint: str, layout: KVLayout, k_caches, v_caches):
    """The client for `endpoint`: a `pdserve store` (tcp://, nixl://) or a Mooncake pool."""
    if endpoint.startswith(SCHEME) and layout.cache != "heads":
        raise ValueError(
            f"--kv-store {endpoint}: a Mooncake pool holds per-head K/V blocks here, not this "
            f"model's {layout.cache} cache (multi-head latent attention); use pdserve's own "
            "store (--kv-store, or tcp:// / nixl:// of `pdserve store`)"
        )
    if endpoint.startswith(SCHEME):
        return MooncakeStoreClient(endpoint, layout, k_caches, v_caches)
    from pdserve.kv_store.client import StoreClient

    return StoreClient(endpoint, layout, k_caches, v_caches)
