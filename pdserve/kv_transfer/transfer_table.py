"""Receiver-side bookkeeping shared by every backend: which blocks each transfer may write, which
layers have landed, and the writer accounting that makes `release` safe.

A writer (a connection thread, or the in-process sender) asks `begin_write` for a ticket before
touching block memory and returns it with `end_write`. `release` marks the transfer released, then
waits until no ticket of it is out; a writer stuck mid-layer (a stalled peer) is cut with the
ticket's `abort` callback after a grace period. Writers check `ticket.released` between spans and
divert the rest of the layer to scratch, so a release waits for at most about one span.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from pdserve.kv_transfer.base import KVReceiver, StatsCounter, TransferStats
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.memory import byte_views, check_block_ids, check_caches

log = logging.getLogger("pdserve.kv_transfer")
_TOMBSTONES = 4096  # released ids remembered, only to word refusals of late data precisely


class _Transfer:
    def __init__(self, block_ids: Sequence[int], num_layers: int) -> None:
        self.block_ids = frozenset(block_ids)
        self.written: list[set[int]] = [set() for _ in range(num_layers)]
        self.landed = [not block_ids] * num_layers  # nothing to receive: every layer is there
        self.writers: list[WriteTicket] = []
        self.released = False
        self.error: str | None = None


class WriteTicket:
    """Permission to write one layer's blocks of one transfer."""

    def __init__(self, state: _Transfer, transfer_id: str, layer: int, dst_ids, abort) -> None:
        self._state = state
        self.transfer_id = transfer_id
        self.layer = layer
        self.dst_ids = dst_ids
        self.abort: Callable[[], None] | None = abort

    @property
    def released(self) -> bool:
        """True once `release` began: the writer must stop touching block memory."""
        return self._state.released


class TransferTable:
    """Thread-safe registry of expected transfers on one receiver."""

    def __init__(self, layout: KVLayout, num_blocks: int, stats: StatsCounter) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self._stats = stats
        self._cond = threading.Condition()
        self._transfers: dict[str, _Transfer] = {}
        self._owner: dict[int, str] = {}  # block id -> live transfer that may write it
        self._released: deque[str] = deque(maxlen=_TOMBSTONES)

    def expect(self, transfer_id: str, block_ids: Sequence[int]) -> None:
        check_block_ids(block_ids, self.num_blocks, "destination")
        with self._cond:
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already expected")
            taken = {b: self._owner[b] for b in block_ids if b in self._owner}
            if taken:
                raise ValueError(
                    f"blocks {sorted(taken)[:8]} are still registered to transfer(s) "
                    f"{sorted(set(taken.values()))[:4]}; release those first"
                )
            self._transfers[transfer_id] = _Transfer(block_ids, self.layout.num_layers)
            self._owner.update(dict.fromkeys(block_ids, transfer_id))

    def begin_write(
        self, transfer_id: str, layer: int, dst_ids: Sequence[int], abort=None
    ) -> WriteTicket | str:
        """A ticket to write `dst_ids` of `layer`, or the reason the write is refused."""
        with self._cond:
            st = self._transfers.get(transfer_id)
            if st is None or st.released:
                return self._unknown(transfer_id)
            bad = [b for b in dst_ids if b not in st.block_ids]
            if bad or len(set(dst_ids)) != len(dst_ids) or not 0 <= layer < len(st.landed):
                why = f"blocks {bad[:8]} are not registered" if bad else "bad layer or repeated ids"
                st.error = st.error or f"refused layer {layer} of {transfer_id!r}: {why}"
                self._cond.notify_all()
                self._stats.add(failures=1)
                return st.error
            ticket = WriteTicket(st, transfer_id, layer, dst_ids, abort)
            st.writers.append(ticket)
            return ticket

    def end_write(
        self, ticket: WriteTicket, error: str | None, nbytes: int, secs: float
    ) -> str | None:
        """Return a ticket; `error` means the layer did not fully land (e.g. connection lost).
        Returns the error to acknowledge the layer with (None: it landed)."""
        with self._cond:
            st = ticket._state
            st.writers.remove(ticket)
            self._cond.notify_all()
            if st.released:  # the rest of the layer went to scratch; nothing counts as landed
                return f"transfer {ticket.transfer_id!r} was released by the receiver mid-layer"
            if error is not None:
                st.error = st.error or error
                self._stats.add(failures=1)
                return error
            self._land(st, ticket, nbytes, secs)
            return None

    def _land(self, st: _Transfer, ticket: WriteTicket, nbytes: int, secs: float) -> None:
        written = st.written[ticket.layer]
        written.update(ticket.dst_ids)
        self._stats.add(bytes=nbytes, seconds=secs)
        if not st.landed[ticket.layer] and len(written) == len(st.block_ids):
            st.landed[ticket.layer] = True
            done = all(st.landed)
            self._stats.add(layers=1, transfers=int(done))

    def _unknown(self, transfer_id: str) -> str:
        if transfer_id in self._released:
            return (
                f"transfer {transfer_id!r} was released by the receiver (lease expired or aborted)"
            )
        return f"transfer {transfer_id!r} is not expected by this receiver"

    def _get(self, transfer_id: str) -> _Transfer:
        st = self._transfers.get(transfer_id)
        if st is None or st.released:
            raise KeyError(f"unknown KV transfer {transfer_id!r}: expect() it first")
        return st

    def layers_landed(self, transfer_id: str) -> int:
        with self._cond:
            return sum(self._get(transfer_id).landed)

    def failed(self, transfer_id: str) -> str | None:
        with self._cond:
            return self._get(transfer_id).error

    def wait_layer(self, transfer_id: str, layer: int, timeout_s: float) -> bool:
        with self._cond:
            st = self._get(transfer_id)
            if not 0 <= layer < len(st.landed):
                raise ValueError(f"layer {layer} is outside [0, {len(st.landed)})")
            self._cond.wait_for(
                lambda: st.landed[layer] or st.error is not None or st.released, timeout_s
            )
            return st.landed[layer] and not st.released

    def release(self, transfer_id: str, grace_s: float = 1.0) -> None:
        """See `KVReceiver.release`. Waits for writers; cuts stuck ones after `grace_s`."""
        with self._cond:
            st = self._transfers.get(transfer_id)
            if st is None:
                return
            st.released = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not st.writers, grace_s)
            stuck = [t.abort for t in st.writers if t.abort is not None]
        for abort in stuck:  # outside the lock: abort() may block briefly
            abort()
        with self._cond:
            t0 = time.monotonic()
            while not self._cond.wait_for(lambda: not st.writers, 5.0):
                log.warning("release(%r): a writer is still draining after %.0f s",
                            transfer_id, time.monotonic() - t0)  # fmt: skip
            del self._transfers[transfer_id]
            for b in st.block_ids:
                del self._owner[b]
            self._released.append(transfer_id)


class TableReceiver(KVReceiver):
    """A KVReceiver whose bookkeeping is a TransferTable; backends add transport and endpoint."""

    def __init__(self, layout: KVLayout, k_caches, v_caches) -> None:
        self.layout = layout
        self.num_blocks = check_caches(layout, k_caches, v_caches)
        self.k_caches, self.v_caches = k_caches, v_caches
        self._k_bytes, self._v_bytes = byte_views(k_caches), byte_views(v_caches)
        self._stats = StatsCounter()
        self._table = TransferTable(layout, self.num_blocks, self._stats)

    def expect(self, transfer_id: str, block_ids: Sequence[int]) -> None:
        self._table.expect(transfer_id, block_ids)

    def layers_landed(self, transfer_id: str) -> int:
        return self._table.layers_landed(transfer_id)

    def wait_layer(self, transfer_id: str, layer: int, timeout_s: float) -> bool:
        return self._table.wait_layer(transfer_id, layer, timeout_s)

    def failed(self, transfer_id: str) -> str | None:
        return self._table.failed(transfer_id)

    def release(self, transfer_id: str) -> None:
        self._table.release(transfer_id)

    def stats(self) -> TransferStats:
        return self._stats.snapshot()
