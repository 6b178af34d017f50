"""The store's index and its two tiers: which blocks are held, in DRAM and on SSD, in LRU order.

`Tiers` does the bookkeeping behind `Store` (store.py): byte counts per tier, demotion DRAM ->
SSD past the DRAM high watermark, deletion of least recently used files at SSD capacity, and
forgetting a block once it is in neither tier (the removal log hears of it). Pinned blocks are
never evicted. Not thread-safe: `Store` calls every method with its lock held.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.kv_store.config import Key, StoreConfig, payload_bytes
from pdserve.kv_store.protocol import BlockMeta
from pdserve.kv_store.removals import RemovalLog
from pdserve.kv_store.ssd import SsdFiles
from pdserve.kv_transfer.layout import KVLayout

log = logging.getLogger("pdserve.kv_store")
Payload = bytes | bytearray | memoryview


@dataclass(eq=False)
class Entry:
    """One block in the index. `data` is its DRAM copy; `ssd_size` > 0 when it has a file."""

    key: Key
    layout: KVLayout
    meta: BlockMeta
    data: Payload | None = None
    ssd_size: int = 0
    pins: int = 0

    @property
    def nbytes(self) -> int:
        return payload_bytes(self.layout)


class Tiers:
    """Blocks by key in DRAM and on SSD (`files`). `count`: the store's counters, to which
    demotions and evictions are added; `removals`: told of every block forgotten."""

    def __init__(
        self, config: StoreConfig, files: SsdFiles, count: Counter[str], removals: RemovalLog
    ) -> None:
        self.config = config
        self.files = files
        self.entries: dict[Key, Entry] = {}
        self.dram: OrderedDict[Key, None] = OrderedDict()  # least recently used first
        self.ssd: OrderedDict[Key, None] = OrderedDict()
        self.dram_used = self.ssd_used = 0
        self._count = count
        self._removals = removals

    def add_file(self, entry: Entry) -> None:
        """Index a block found on SSD at startup (`entry.ssd_size` set), as most recently used."""
        self.entries[entry.key] = entry
        self.ssd[entry.key] = None
        self.ssd_used += entry.ssd_size

    def leading(self, keys: Sequence[Key]) -> list[Entry]:
        """The held blocks of `keys` up to the first one not held."""
        out = []
        for k in keys:
            if (e := self.entries.get(k)) is None:
                break
            out.append(e)
        return out

    def touch(self, e: Entry) -> None:
        for tier in (self.dram, self.ssd):
            if e.key in tier:
                tier.move_to_end(e.key)

    def add_dram(self, entry: Entry, data: Payload) -> None:
        entry.data = data
        self.dram[entry.key] = None
        self.dram_used += entry.nbytes
        self.enforce_dram()

    def enforce_dram(self) -> None:
        if self.dram_used <= self.config.dram_high_bytes:
            return
        for key in list(self.dram):
            if self.dram_used <= self.config.dram_low_bytes:
                break
            entry = self.entries[key]
            if not entry.pins:
                self._demote(entry)

    def _demote(self, e: Entry) -> None:
        """Move `e` out of DRAM: to SSD if it is not there yet and fits, else drop it."""
        if not e.ssd_size:
            self._add_ssd(e)
        if e.ssd_size:
            self._count["demotions"] += 1
        else:
            self._count["evictions_dram"] += 1
        del self.dram[e.key]
        self.dram_used -= e.nbytes
        e.data = None
        self._forget_if_gone(e)

    def _add_ssd(self, e: Entry) -> None:
        head = SsdFiles.encode_head(e.layout, e.meta, e.nbytes)
        size = SsdFiles.file_size(head, e.nbytes)
        if not self.make_ssd_room(size, keep=e):
            return
        try:
            self.files.write(e.key, head, e.data)  # type: ignore[arg-type]
        except OSError as exc:
            log.warning("KV store: cannot write block file (%s); dropping the block", exc)
            return
        e.ssd_size = size
        self.ssd[e.key] = None
        self.ssd_used += size

    def make_ssd_room(self, size: int, keep: Entry | None = None) -> bool:
        """Delete least recently used unpinned files until `size` more bytes fit."""
        for key in list(self.ssd):
            if self.ssd_used + size <= self.config.ssd_bytes:
                break
            victim = self.entries[key]
            if not victim.pins and victim is not keep:
                self.remove_ssd(victim)
                self._count["evictions_ssd"] += 1
        return self.ssd_used + size <= self.config.ssd_bytes

    def remove_ssd(self, e: Entry) -> None:
        if e.key in self.ssd:
            del self.ssd[e.key]
            self.ssd_used -= e.ssd_size
        e.ssd_size = 0
        self.files.delete(e.key)
        self._forget_if_gone(e)

    def _forget_if_gone(self, e: Entry) -> None:
        if e.data is None and not e.ssd_size and self.entries.get(e.key) is e:
            del self.entries[e.key]
            self._removals.append(e.key)
