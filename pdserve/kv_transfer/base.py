"""The KV transfer connector interface: what a prefill worker and a decode worker share.

A prefill worker holds a `KVSender`; after each layer's forward pass it calls `send_layer`, which
only queues the layer: a background thread moves it while the next layer computes. `wait` then
tells whether every queued layer of the transfer has landed. A decode worker holds a `KVReceiver`;
it registers the destination blocks of a transfer with `expect` before handing out its endpoint,
watches `layers_landed` / `wait_layer`, and calls `release` when the transfer is done, aborted or
its lease has expired.

Cache memory belongs to the engine: per layer `l`, `k_caches[l]` and `v_caches[l]` are contiguous
CPU tensors of shape `[num_blocks, block_size, num_kv_heads, head_dim]` (an MLA latent cache:
`k_caches[l]` alone, of one head, and `v_caches` empty; `KVLayout.cache` says which). Connectors
read and write block memory in place; they never allocate a copy of the cache.

What a cache holds, and which heads each tensor-parallel rank has, is its `KVLayout`
(`kv_transfer/layout.py`): the handshake compares layouts, and a sender of a
group reads every rank's caches while a receiver is one rank's.

This module must stay importable without torch (the router imports `KVLayout`).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class TransferResult(NamedTuple):
    """Outcome of one transfer as seen by the sender."""

    ok: bool
    bytes_sent: int
    seconds: float
    error: str | None


@dataclass(frozen=True)
class TransferStats:
    """Counters of one connector, for metrics (monotonic; export as Prometheus counters).

    Sender: bytes/layers acknowledged, transfers finished by `wait` (ok or failed).
    Receiver: bytes/layers landed in blocks, transfers whose every layer landed, failures
    (refused layers, refused handshakes, connections lost mid-layer).
    """

    bytes: int = 0
    seconds: float = 0.0
    layers: int = 0
    transfers: int = 0
    failures: int = 0


class StatsCounter:
    """Thread-safe accumulator behind `stats()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = TransferStats()

    def add(self, **deltas: float) -> None:
        with self._lock:
            cur = self._stats
            self._stats = TransferStats(
                **{k: getattr(cur, k) + deltas.get(k, 0) for k in cur.__dataclass_fields__}
            )

    def snapshot(self) -> TransferStats:
        with self._lock:
            return self._stats


class KVSender(ABC):
    """Prefill side. Reads source block memory in place; never copies the whole cache.

    Thread-safety: `send_layer`/`wait` may be called from the engine thread while the background
    thread sends; different transfers may be in flight at once, to one or several endpoints.
    """

    @abstractmethod
    def send_layer(
        self,
        dest_endpoint: str,
        transfer_id: str,
        layer: int,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> None:
        """Queue layer `layer` of blocks `src_block_ids` for writing into `dst_block_ids` at
        `dest_endpoint` and return at once. The caller must not overwrite those source blocks of
        that layer until `wait(transfer_id)` returns. Raises ValueError on bad ids (checked now).
        """

    @abstractmethod
    def wait(self, transfer_id: str, timeout_s: float) -> TransferResult:
        """Block until every queued layer of `transfer_id` has landed (acknowledged by the
        receiver where the backend acknowledges), or it failed, or `timeout_s` passed. On return
        the sender no longer reads that transfer's source blocks, whatever the outcome (a failed
        or timed-out transfer is cancelled: layers still queued are dropped, an in-flight one is
        cut). The transfer is then forgotten; waiting on an unknown id returns ok with 0 bytes.
        """

    @abstractmethod
    def settled(self, transfer_id: str) -> bool:
        """Whether `wait(transfer_id)` would return at once (every queued layer acknowledged,
        or the transfer failed); never blocks."""

    @abstractmethod
    def wait_change(self, timeout_s: float) -> None:
        """Block until some transfer makes progress or fails, or `timeout_s` passes: lets a
        caller that polls `settled` sleep without missing an acknowledgement."""

    @abstractmethod
    def cancel(self, transfer_id: str, reason: str) -> TransferResult:
        """Fail `transfer_id` with `reason` unless it already ended, and return as `wait` does:
        once the sender no longer reads its source blocks (an in-flight layer is cut)."""

    @abstractmethod
    def close_endpoint(self, endpoint: str) -> None:
        """Drop the connection to `endpoint` (a receiver that stopped acknowledging, or died);
        layers still queued to it fail. A later `send_layer` to it connects afresh."""

    @abstractmethod
    def stats(self) -> TransferStats:
        """Counters since construction."""

    @abstractmethod
    def close(self) -> None:
        """Stop background threads and close connections. Pending transfers fail."""


class KVReceiver(ABC):
    """Decode side. Writes only into blocks registered with `expect` for the same transfer id.

    Thread-safety: every method may be called from the engine thread while connection threads
    write blocks.
    """

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """Address senders are given, e.g. "tcp://127.0.0.1:40123"."""

    @property
    def endpoints(self) -> list[str]:
        """Every rank's endpoint, in rank order (one, unless a tensor-parallel group's)."""
        return [self.endpoint]

    @abstractmethod
    def start(self) -> None:
        """Start accepting senders."""

    @abstractmethod
    def expect(self, transfer_id: str, block_ids: Sequence[int]) -> None:
        """Register the destination blocks of a transfer: every block the sender will write, in
        every layer. Data for other blocks, or for an unregistered or released id, is refused and
        discarded. Raises ValueError for a reused id, an out-of-range or duplicate block, or a
        block already registered to another live transfer.
        """

    @abstractmethod
    def layers_landed(self, transfer_id: str) -> int:
        """Number of layers whose every registered block has landed (KeyError if unknown)."""

    @abstractmethod
    def wait_layer(self, transfer_id: str, layer: int, timeout_s: float) -> bool:
        """Block until `layer` has fully landed: True; False on timeout, failure or release."""

    @abstractmethod
    def failed(self, transfer_id: str) -> str | None:
        """Why the transfer failed (refused data, connection lost mid-layer), else None."""

    @abstractmethod
    def release(self, transfer_id: str) -> None:
        """Forget the transfer. After this returns no byte is ever written into its blocks again
        (late data is read and discarded), so the engine may free or reuse them. Unknown ids are
        ignored, so release is idempotent.
        """

    @abstractmethod
    def stats(self) -> TransferStats:
        """Counters since construction."""

    @abstractmethod
    def close(self) -> None:
        """Stop accepting, close connections, join threads."""


CacheList = Sequence["torch.Tensor"]
