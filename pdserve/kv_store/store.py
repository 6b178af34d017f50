"""The store's index: a DRAM tier and an SSD tier with LRU order, pins and leases.

A block lives in DRAM, on SSD, or both (an SSD hit is promoted to DRAM and keeps its file, so
demoting it again costs nothing). Capacities are enforced on every insert:

* DRAM over its high watermark: least recently used unpinned blocks leave DRAM (written to SSD
  first unless already there) until DRAM is at its low watermark.
* SSD full: least recently used unpinned files are deleted until the new file fits; if it
  cannot fit (everything pinned, or the tier is off), the block is dropped. Full tiers evict;
  they never fail a put.

A pinned block (held by a load in progress, or by a lease a client took with a lookup) is never
evicted from either tier. Leases expire after their TTL, so a client that dies leaks nothing.
All methods are thread-safe; file reads for loads happen outside the lock, under a pin.

`Store` holds the lock, pins and leases, promotion on an SSD hit and the counters; the tiers'
bookkeeping (byte counts, LRU order, demotion and eviction) is `Tiers` in tiers.py.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from pdserve.kv_store.config import Key, StoreConfig, payload_bytes
from pdserve.kv_store.protocol import BlockMeta, StoreStats, chains
from pdserve.kv_store.removals import RemovalLog
from pdserve.kv_store.ssd import CorruptRecord, SsdFiles
from pdserve.kv_store.tiers import Entry, Payload, Tiers
from pdserve.kv_transfer.layout import KVLayout

log = logging.getLogger("pdserve.kv_store")


class Store:
    """Blocks by key in two tiers. `clock` is injectable so that lease expiry is testable."""

    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        # Where promoted SSD blocks go in DRAM: a nixl store's registered memory (None: plain
        # memory). Returns None when it is full.
        self.alloc: Callable[[int], Payload | None] | None = None
        self._lock = threading.Lock()
        self._files = SsdFiles(config.store_dir)
        self._leases: dict[int, tuple[list[Entry], float]] = {}
        self._lease_ids = itertools.count(1)
        self._count: Counter[str] = Counter()
        self._load_seconds = 0.0
        self._removals = RemovalLog()
        self._tiers = Tiers(config, self._files, self._count, self._removals)
        self._recover()

    def _recover(self) -> None:
        """Rebuild the SSD index from the files (oldest first), then enforce the capacity."""
        found, dropped = self._files.scan(self.config.verify_on_start)
        self._count["corrupt_dropped"] += dropped
        for rec in found:
            self._tiers.add_file(Entry(rec.key, rec.layout, rec.meta, ssd_size=rec.size))
        with self._lock:
            self._tiers.make_ssd_room(0)
        if found or dropped:
            log.info("KV store: recovered %d blocks from %s (%d bad files dropped)",
                     len(self._tiers.entries), self.config.store_dir, dropped)  # fmt: skip

    # --- requests -------------------------------------------------------------------------

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        with self._lock:
            return [k in self._tiers.entries for k in keys]

    def put(self, key: Key, layout: KVLayout, meta: BlockMeta, payload: Payload) -> bool:
        """Store one block; False if already held or refused (its hash does not match its
        tokens, or the payload size does not match the layout)."""
        if (
            len(payload) != payload_bytes(layout)
            or len(meta.token_ids) != layout.block_size
            or not chains(meta)
        ):
            self._bump("blocks_rejected")
            return False
        with self._lock:
            self._expire_leases()  # expired pins must not keep blocks from being evicted
            self._count["bytes_in"] += len(payload)
            if key in self._tiers.entries:
                self._tiers.touch(self._tiers.entries[key])
                self._count["blocks_put_duplicate"] += 1
                return False
            entry = Entry(key, layout, meta)
            self._tiers.entries[key] = entry
            self._tiers.add_dram(entry, payload)
            self._count["blocks_put"] += 1
            return True

    def pin_prefix(self, keys: Sequence[Key], ttl_s: float) -> int | None:
        """Pin the leading held blocks of `keys` for at most `ttl_s` (capped by max_lease_s);
        return the lease id to `unpin`, or None when nothing is held."""
        with self._lock:
            self._expire_leases()
            entries = self._tiers.leading(keys)
            if not entries:
                return None
            for e in entries:
                e.pins += 1
            lease = next(self._lease_ids)
            ttl = min(ttl_s, self.config.max_lease_s)
            self._leases[lease] = (entries, self._clock() + ttl)
            return lease

    def unpin(self, lease: int | None) -> None:
        """End a lease (unknown or expired ids are ignored)."""
        with self._lock:
            self._end_lease(lease)

    def acquire(self, keys: Sequence[Key]) -> list[Entry]:
        """Pin the leading held blocks of `keys` for reading; pass them to `release` after."""
        with self._lock:
            self._expire_leases()
            entries = self._tiers.leading(keys)
            for e in entries:
                e.pins += 1
                self._tiers.touch(e)
            return entries

    def release(self, entries: Sequence[Entry]) -> None:
        with self._lock:
            for e in entries:
                e.pins -= 1
            self._tiers.enforce_dram()  # blocks pinned past the watermark may leave DRAM now

    def buffer(self, nbytes: int) -> Payload:
        """A buffer for a block the DRAM tier may keep: from `alloc` (a nixl store's registered
        memory) while it has room, else plain memory."""
        slot = self._slot(nbytes)
        return slot if slot is not None else bytearray(nbytes)

    def read(self, entry: Entry) -> Payload | None:
        """The payload of an acquired block, from DRAM or from its file (checksummed, then
        promoted to DRAM, in `alloc`'s memory while it has room). None if the file is corrupt:
        the block is then dropped. A block another load promoted while we read its file is
        served from that copy, one that left the index meanwhile from the file's bytes: only a
        promotion takes `alloc`'s memory."""
        with self._lock:
            data = entry.data
            if data is not None:
                self._count["hits_dram"] += 1
                return data
        try:
            data = self._files.read(entry.key, entry.nbytes)
        except CorruptRecord as exc:
            log.warning("KV store: dropping block %x: %s", entry.key.block_hash, exc)
            with self._lock:
                self._count["corrupt_dropped"] += 1
                self._tiers.remove_ssd(entry)
            return None
        with self._lock:
            self._count["hits_ssd"] += 1
            if entry.data is not None:  # another load promoted it meanwhile: serve that copy
                return entry.data
            if self._tiers.entries.get(entry.key) is entry:
                # Copied under the lock so that only the promoted copy takes DRAM's (on a nixl
                # store, registered) memory: a block's memcpy, next to the file writes that
                # demotions already do under it.
                promoted = self._dram_copy(data)
                self._tiers.add_dram(entry, promoted)
                return promoted
            return data

    def removal_cursor(self) -> int:
        """Where a new reader of the removal log starts (it is told only later removals)."""
        with self._lock:
            return self._removals.end

    def removed_since(self, cursor: int, layout_key: str, limit: int) -> tuple[list[int], int]:
        """Block hashes of `layout_key` removed from the store since `cursor` (at most
        `limit`), and the next cursor."""
        with self._lock:
            return self._removals.read(cursor, layout_key, limit)

    def record_load(self, requested: int, served: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._count["loads"] += 1
            self._count["misses"] += requested - served
            self._count["bytes_out"] += nbytes
            self._load_seconds += seconds

    def stats(self) -> StoreStats:
        with self._lock:
            t = self._tiers
            return StoreStats(
                **self._count,
                load_seconds=self._load_seconds,
                dram_blocks=len(t.dram),
                dram_bytes=t.dram_used,
                ssd_blocks=len(t.ssd),
                ssd_bytes=t.ssd_used,
                pinned_blocks=sum(1 for e in t.entries.values() if e.pins),
            )

    def tier_keys(self) -> tuple[list[Key], list[Key]]:
        """Keys in DRAM and on SSD, least recently used first (for tests and integrity checks)."""
        with self._lock:
            return list(self._tiers.dram), list(self._tiers.ssd)

    def check_integrity(self, idle: bool = True) -> None:
        """Raise AssertionError naming the first broken invariant: byte counts match the tiers,
        every indexed block is in a tier, the files are exactly the SSD index, and (`idle`: no
        load in progress) every pin is held by a live lease, so no pin leaked."""
        with self._lock:
            t = self._tiers
            dram = [t.entries[k] for k in t.dram]
            ssd = [t.entries[k] for k in t.ssd]
            assert t.dram_used == sum(e.nbytes for e in dram), "DRAM byte count is off"
            assert t.ssd_used == sum(e.ssd_size for e in ssd), "SSD byte count is off"
            leased = Counter(e.key for entries, _ in self._leases.values() for e in entries)
            for key, e in t.entries.items():
                assert (e.data is not None) == (key in t.dram), f"{key}: DRAM state"
                assert bool(e.ssd_size) == (key in t.ssd), f"{key}: SSD state"
                assert e.data is not None or e.ssd_size, f"{key}: indexed but in no tier"
                assert e.pins == leased[key] or (not idle and e.pins > leased[key]), (
                    f"{key}: {e.pins} pins but {leased[key]} leases"
                )
            files = set(self.config.store_dir.glob("*/*.kvb"))
            assert files == {self._files.path(e.key) for e in ssd}, "SSD files != SSD index"

    # --- internals (lock held) ------------------------------------------------------------

    def _bump(self, name: str) -> None:
        with self._lock:
            self._count[name] += 1

    def _slot(self, nbytes: int) -> Payload | None:
        return self.alloc(nbytes) if self.alloc is not None else None

    def _dram_copy(self, data: Payload) -> Payload:
        """`data` in a buffer from `alloc` while it has room, else `data` itself."""
        if (slot := self._slot(len(data))) is None:
            return data
        slot[:] = data  # type: ignore[index]
        return slot

    def _expire_leases(self) -> None:
        now = self._clock()
        for lease in [lid for lid, (_, deadline) in self._leases.items() if deadline <= now]:
            self._end_lease(lease)

    def _end_lease(self, lease: int | None) -> None:
        entries, _ = self._leases.pop(lease, ((), 0.0))  # type: ignore[arg-type]
        for e in entries:
            e.pins -= 1
