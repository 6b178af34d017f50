"""Sender machinery shared by every backend: validation, one background thread and one link per
destination endpoint, and per-transfer progress that `wait` blocks on.

A layer goes through: queued (`send_layer`) -> reading (the channel thread moves its bytes) ->
acknowledged (the receiver says it landed, or refused it). `wait` returns when every queued layer
is acknowledged, or on the first error or the timeout; a failed transfer is cancelled and `wait`
returns only once no channel reads its source blocks any more.

Over 300 lines on purpose: the transfer states, the channel threads that move them and the
cancellation that must never leave a thread reading freed blocks are one state machine, read
best in one place.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from pdserve.kv_transfer.base import KVSender, StatsCounter, TransferResult, TransferStats
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.memory import check_caches, check_layer_blocks

log = logging.getLogger("pdserve.kv_transfer")
_ERROR_GRACE_S = 1.0  # after a refusal, let an in-flight layer finish before cutting the link
_ABORT_WAIT_S = 5.0  # a cut link frees its reader at once; this bound only guards against bugs


class Job(NamedTuple):
    """One layer of one transfer to one endpoint."""

    endpoint: str
    transfer_id: str
    layer: int
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]


class _Progress:
    def __init__(self) -> None:
        self.queued = self.acked = self.reading = self.bytes = 0
        self.error: str | None = None
        self.t0 = time.perf_counter()
        self.t_end = self.t0


class SendTracker:
    """Per-transfer progress; thread-safe."""

    def __init__(self, stats: StatsCounter) -> None:
        self._cond = threading.Condition()
        self._progress: dict[str, _Progress] = {}
        self._stats = stats

    def queue(self, transfer_id: str) -> None:
        with self._cond:
            self._progress.setdefault(transfer_id, _Progress()).queued += 1
            self._cond.notify_all()

    def begin(self, transfer_id: str) -> bool:
        """Mark a layer as being read; False if the transfer failed or ended (skip the layer)."""
        with self._cond:
            p = self._progress.get(transfer_id)
            if p is None or p.error is not None:
                return False
            p.reading += 1
            return True

    def end(self, transfer_id: str) -> None:
        with self._cond:
            self._progress[transfer_id].reading -= 1
            self._cond.notify_all()

    def acked(self, transfer_id: str, nbytes: int, error: str | None) -> None:
        with self._cond:
            p = self._progress.get(transfer_id)
            if p is None:
                return  # the transfer already ended (wait gave up on it)
            if error is None:
                p.acked += 1
                p.bytes += nbytes
                p.t_end = time.perf_counter()
                self._stats.add(bytes=nbytes, layers=1)
            else:
                p.error = p.error or error
            self._cond.notify_all()

    def fail(self, transfer_id: str, error: str) -> None:
        self.acked(transfer_id, 0, error)

    def wait_busy(self, timeout_s: float) -> bool:
        """Block until some transfer has layers not yet acknowledged (True) or the timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: any(
                    p.error is None and p.acked < p.queued for p in self._progress.values()
                ),
                timeout_s,
            )

    def fail_all(self, error: str) -> None:
        with self._cond:
            for p in self._progress.values():
                p.error = p.error or error
            self._cond.notify_all()

    def settled(self, transfer_id: str) -> bool:
        """Whether `wait` would return at once: every queued layer acknowledged, or failed."""
        with self._cond:
            p = self._progress.get(transfer_id)
            return p is None or p.error is not None or p.acked == p.queued

    def wait_change(self, timeout_s: float) -> None:
        """Block until some transfer makes progress or fails, or the timeout."""
        with self._cond:
            self._cond.wait(timeout_s)

    def wait(
        self,
        transfer_id: str,
        timeout_s: float,
        abort: Callable[[str], None],
        fail: str | None = None,
    ) -> TransferResult:
        """See `KVSender.wait` (and `cancel`: `fail` is the reason); `abort(transfer_id)` cuts
        a layer that is still being read."""
        with self._cond:
            p = self._progress.get(transfer_id)
            if p is None:
                return TransferResult(True, 0, 0.0, None)
            if fail is not None:
                p.error = p.error or fail
            done = self._cond.wait_for(lambda: p.error or p.acked == p.queued, timeout_s)
            if not done:
                p.error = (
                    f"timed out after {timeout_s:g} s: {p.acked} of {p.queued} layers "
                    "acknowledged by the receiver"
                )
            if p.error is not None and p.reading:
                self._cond.wait_for(
                    lambda: not p.reading, _ERROR_GRACE_S if done and fail is None else 0.0
                )
        if p.error is not None and p.reading:
            abort(transfer_id)
        with self._cond:
            if not self._cond.wait_for(lambda: not p.reading, _ABORT_WAIT_S):
                log.error("transfer %r: a channel still reads its blocks after abort", transfer_id)
            self._progress.pop(transfer_id, None)  # two concurrent waits: either may pop
        ok = p.error is None
        seconds = (p.t_end if ok else time.perf_counter()) - p.t0
        # stats.seconds is time spent moving bytes, so failed transfers only count as failures
        self._stats.add(transfers=1, seconds=seconds if ok else 0.0, failures=int(not ok))
        return TransferResult(ok, p.bytes, seconds, p.error)


class Link(ABC):
    """A connection from this sender to one endpoint, used by one channel thread."""

    @property
    def alive(self) -> bool:
        """False once the connection is known dead; the channel then opens a new link."""
        return True

    @abstractmethod
    def send(self, job: Job) -> None:
        """Move one layer; report its acknowledgement to the tracker (now or later)."""

    @abstractmethod
    def abort(self) -> None:
        """Called from another thread: make a blocked `send` fail promptly."""

    @abstractmethod
    def close(self) -> None:
        """Close; acknowledgements still pending are reported as failures."""


class _Channel:
    """One endpoint's job queue and the thread that drains it, in order."""

    def __init__(self, endpoint: str, sender: QueuedSender) -> None:
        self.endpoint = endpoint
        self._sender = sender
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _current and _link against abort()
        self._current: str | None = None
        self._link: Link | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"kv-send {endpoint}", daemon=True)
        self._thread.start()

    def put(self, job: Job | None) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        tracker = self._sender._tracker
        while (job := self._jobs.get()) is not None:
            if self._stopping:
                tracker.fail(job.transfer_id, f"the connection to {job.endpoint} was closed")
                continue
            if not tracker.begin(job.transfer_id):
                continue
            with self._lock:
                self._current = job.transfer_id
            try:
                if self._link is not None and not self._link.alive:
                    self._drop_link()  # e.g. the receiver restarted while this link was idle
                if self._link is None:
                    self._link = self._sender._connect(job.endpoint)
                self._link.send(job)
            except Exception as exc:  # any failure of this link fails the layer, never the thread
                tracker.fail(job.transfer_id, f"sending to {job.endpoint} failed: {exc}")
                self._drop_link()
            finally:
                with self._lock:
                    self._current = None
                tracker.end(job.transfer_id)
        self._drop_link()

    def _drop_link(self) -> None:
        with self._lock:
            link, self._link = self._link, None
        if link is not None:
            link.close()

    def abort_if_current(self, transfer_id: str) -> None:
        with self._lock:
            if self._current == transfer_id and self._link is not None:
                self._link.abort()

    def stop(self) -> None:
        self._stopping = True  # jobs still queued fail instead of being sent
        self._jobs.put(None)
        self.abort_if_current(self._current or "")
        self._thread.join(timeout=10)


class QueuedSender(KVSender):
    """A KVSender whose backends only say how to connect (`_connect`) and move a layer (Link).

    `ranks`: the caches of every rank of a tensor-parallel group, `(k_caches, v_caches)` in rank
    order (rank 0's are `k_caches`, `v_caches`); each receiver is sent its own heads of them."""

    def __init__(self, layout: KVLayout, k_caches, v_caches, ranks=None) -> None:
        self.layout = layout
        self.num_blocks = check_caches(layout, k_caches, v_caches)
        self.k_caches: Sequence[torch.Tensor] = k_caches
        self.v_caches: Sequence[torch.Tensor] = v_caches
        self.ranks: list[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]] = list(
            ranks or [(k_caches, v_caches)]
        )
        if len(self.ranks) != layout.tp_size:
            raise ValueError(
                f"a sender of a tensor-parallel group of {layout.tp_size} needs the caches of "
                f"every rank, got {len(self.ranks)}"
            )
        for rank, (k, v) in enumerate(self.ranks):
            if check_caches(layout.shard(rank), k, v) != self.num_blocks:
                raise ValueError(f"rank {rank}'s KV cache has another number of blocks")
        self._stats = StatsCounter()
        self._tracker = SendTracker(self._stats)
        self._channels: dict[str, _Channel] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _payload_bytes(self, num_blocks: int, dest: KVLayout | None = None) -> int:
        """Bytes one layer of `num_blocks` blocks puts on the wire (K and V), to a receiver of
        layout `dest` (its heads; default: this sender's)."""
        layout = dest or self.layout
        return layout.tensors * num_blocks * layout.block_bytes

    @abstractmethod
    def _check_endpoint(self, endpoint: str) -> None:
        """Raise ValueError if `endpoint` is not an address of this backend."""

    @abstractmethod
    def _connect(self, endpoint: str) -> Link:
        """Open a link to `endpoint` (connect and handshake); raise with a clear message."""

    def send_layer(self, dest_endpoint, transfer_id, layer, src_block_ids, dst_block_ids) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.layout.num_layers})")
        check_layer_blocks(src_block_ids, dst_block_ids, self.num_blocks)
        job = Job(dest_endpoint, transfer_id, layer, tuple(src_block_ids), tuple(dst_block_ids))
        with self._lock:
            if self._closed:
                raise RuntimeError("send_layer on a closed KV sender")
            channel = self._channels.get(dest_endpoint)
            if channel is None:
                self._check_endpoint(dest_endpoint)
                channel = self._channels[dest_endpoint] = _Channel(dest_endpoint, self)
            self._tracker.queue(transfer_id)
            channel.put(job)

    def wait(self, transfer_id: str, timeout_s: float) -> TransferResult:
        return self._tracker.wait(transfer_id, timeout_s, self._abort)

    def settled(self, transfer_id: str) -> bool:
        return self._tracker.settled(transfer_id)

    def wait_change(self, timeout_s: float) -> None:
        self._tracker.wait_change(timeout_s)

    def cancel(self, transfer_id: str, reason: str) -> TransferResult:
        return self._tracker.wait(transfer_id, 0.0, self._abort, fail=reason)

    def _abort(self, transfer_id: str) -> None:
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            channel.abort_if_current(transfer_id)

    def stats(self) -> TransferStats:
        return self._stats.snapshot()

    def close_endpoint(self, endpoint: str) -> None:
        with self._lock:
            channel = self._channels.pop(endpoint, None)
        if channel is not None:
            channel.stop()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        self._tracker.fail_all("the KV sender was closed")
        for channel in channels:
            channel.stop()
