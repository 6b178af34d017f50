"""The store's log of removed blocks, so that its clients can tell the router's index.

A block is *removed* when it leaves the store entirely: evicted from DRAM with no SSD copy,
deleted from a full SSD tier, or dropped as corrupt (demotion to SSD is not a removal). Every
connection reads the log from where it last stopped and passes the hashes of its layout along
with its replies. The log is bounded: a connection that falls more than `capacity` removals
behind misses the oldest (the router's index then keeps a few stale hashes: a decode worker
computes more than the router expected, nothing worse).
"""

from __future__ import annotations

import itertools
from collections import deque

from pdserve.kv_store.config import Key


class RemovalLog:
    """Not thread-safe: the store calls it under its lock."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._keys: deque[Key] = deque(maxlen=capacity)
        self.end = 0  # position after the newest removal; a new reader starts here

    def append(self, key: Key) -> None:
        self._keys.append(key)
        self.end += 1

    def read(self, cursor: int, layout_key: str, limit: int) -> tuple[list[int], int]:
        """Hashes of `layout_key` removed at positions >= `cursor` (at most `limit`), and the
        cursor to read from next time."""
        first = self.end - len(self._keys)  # position of the oldest removal still held
        pos = max(cursor, first)
        hashes = []
        for key in itertools.islice(self._keys, pos - first, None):
            if len(hashes) == limit:
                break
            pos += 1
            if key.layout_key == layout_key:
                hashes.append(key.block_hash)
        return hashes, pos
