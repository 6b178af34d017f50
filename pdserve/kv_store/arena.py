"""Memory registered with NIXL once, handed out in slots that free themselves (nixl path only).

A peer can READ only memory whose registration it learned from this agent's metadata, and NIXL
keeps the first registration it learned for an address range: memory registered, deregistered
and registered again would be read with a stale key. So the nixl path never registers per
request: each side registers one region when it starts, includes it in the metadata it hands
out, and carves block buffers out of it.

The region is cut into chunks (`chunk_bytes`); a chunk holds slots of one size while any of them
is alive and goes back to the pool when all are free, so blocks of several layouts share it. A
slot is a `memoryview` that frees itself when the last reference to it (or to a view of it) is
gone, exactly like the bytearrays the tcp path uses: a block evicted while a tcp load is still
sending it stays valid until that send is done. `alloc` returns None when the region is full;
callers fall back to ordinary memory (which NIXL cannot serve, see the callers).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from pdserve.kv_transfer.nixl_agent import NixlAgent


class Arena:
    """`capacity` bytes (rounded up to whole chunks) registered with `agent`, in slots.
    The memory is reserved, not touched: pages are committed as slots are first written."""

    def __init__(self, agent: NixlAgent, capacity: int, chunk_bytes: int = 64 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        chunks = max(1, -(-capacity // chunk_bytes))
        self._mem = np.empty(chunks * chunk_bytes, dtype=np.uint8)
        self.base, self.nbytes = self._mem.ctypes.data, self._mem.nbytes
        agent.register(self.base, self.nbytes)
        self._lock = threading.Lock()
        self._empty = list(reversed(range(chunks)))  # chunks with no live slot
        self._free: dict[int, list[int]] = {}  # chunk -> offsets of its free slots
        self._live = [0] * chunks  # live slots per chunk
        self._open: dict[int, dict[int, None]] = {}  # slot size -> its chunks with a free slot

    def alloc(self, nbytes: int) -> memoryview | None:
        """A writable slot of `nbytes` inside the registered region, or None if none is free."""
        if not 0 < nbytes <= self.chunk_bytes:
            return None
        with self._lock:
            open_chunks = self._open.setdefault(nbytes, {})
            if not open_chunks:
                if not self._empty:
                    return None
                chunk = self._empty.pop()
                start = chunk * self.chunk_bytes
                count = self.chunk_bytes // nbytes
                self._free[chunk] = [start + i * nbytes for i in reversed(range(count))]
                open_chunks[chunk] = None
            chunk = next(iter(open_chunks))
            offset = self._free[chunk].pop()
            if not self._free[chunk]:
                del open_chunks[chunk]
            self._live[chunk] += 1
        view = self._mem[offset : offset + nbytes]
        weakref.finalize(view, self._release, offset, nbytes).atexit = False
        return memoryview(view)  # keeps `view` alive; slices of it keep the memoryview alive

    def _release(self, offset: int, nbytes: int) -> None:
        chunk = offset // self.chunk_bytes
        with self._lock:
            self._live[chunk] -= 1
            if self._live[chunk] == 0:  # the whole chunk is free: any slot size may use it
                self._open[nbytes].pop(chunk, None)
                del self._free[chunk]
                self._empty.append(chunk)
                return
            self._free[chunk].append(offset)
            self._open[nbytes][chunk] = None

    def address(self, buf) -> int | None:
        """Where `buf` starts if it lies inside the registered region, else None."""
        addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data if len(buf) else 0
        inside = self.base <= addr and addr + len(buf) <= self.base + self.nbytes
        return addr if inside else None

    @property
    def live_slots(self) -> int:
        with self._lock:
            return sum(self._live)
