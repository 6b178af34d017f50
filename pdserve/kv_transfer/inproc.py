"""In-process connector for tests: senders find receivers in a module-level endpoint table and
copy blocks with `Tensor.copy_`, through the same queue, tracking and release logic as tcp.

`FaultPlan` injects the failures a real network and real peers produce, so the layers above
(leases, aborts, retries) can be tested deterministically:

* drop_layers: the layer is lost silently; the sender believes it landed (only the receiver's
  lease deadline can notice),
* fail_layers: the layer fails and the sender's `wait` reports it,
* corrupt_layers: the layer lands with the first byte of every block flipped,
* delay_s: every layer waits this long before it moves,
* fail_handshake: connecting to any receiver is refused.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

from pdserve.kv_transfer.layout import KVLayout, KVLayoutMismatch
from pdserve.kv_transfer.memory import layer_caches, paired_runs
from pdserve.kv_transfer.send_queue import Job, Link, QueuedSender
from pdserve.kv_transfer.transfer_table import TableReceiver
from pdserve.kv_transfer.wire import HandshakeRefused

_ENDPOINTS: dict[str, InprocReceiver] = {}
_ENDPOINTS_LOCK = threading.Lock()


@dataclass(frozen=True)
class FaultPlan:
    """Faults an InprocSender injects; `transfer_ids` limits them to those transfers."""

    drop_layers: frozenset[int] = frozenset()
    fail_layers: frozenset[int] = frozenset()
    corrupt_layers: frozenset[int] = frozenset()
    delay_s: float = 0.0
    fail_handshake: bool = False
    transfer_ids: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.delay_s < 0:
            raise ValueError(f"FaultPlan.delay_s must be >= 0, got {self.delay_s}")
        for name in ("drop_layers", "fail_layers", "corrupt_layers"):
            if not isinstance(getattr(self, name), frozenset):
                raise TypeError(f"FaultPlan.{name} must be a frozenset of layer indices")

    def hits(self, transfer_id: str) -> bool:
        return self.transfer_ids is None or transfer_id in self.transfer_ids


class InprocLink(Link):
    def __init__(self, sender: InprocSender, receiver: InprocReceiver) -> None:
        self._sender = sender
        self._receiver = receiver
        self._aborted = threading.Event()

    def send(self, job: Job) -> None:
        plan, tracker = self._sender.faults, self._sender._tracker
        hit = plan.hits(job.transfer_id)
        nbytes = self._sender._payload_bytes(len(job.src_ids))
        if hit and plan.delay_s and self._aborted.wait(plan.delay_s):
            raise ConnectionError("aborted while delayed")  # like a socket cut mid-layer
        if hit and job.layer in plan.drop_layers:
            tracker.acked(job.transfer_id, nbytes, None)
        elif hit and job.layer in plan.fail_layers:
            tracker.fail(job.transfer_id, f"injected fault: layer {job.layer} failed")
        else:
            corrupt = hit and job.layer in plan.corrupt_layers
            error = self._receiver._deliver(job, self._sender, corrupt)
            tracker.acked(job.transfer_id, nbytes, error)

    def abort(self) -> None:
        self._aborted.set()  # cuts an injected delay; a copy itself finishes in milliseconds

    def close(self) -> None:
        pass


class InprocSender(QueuedSender):
    """Sender to InprocReceivers of this process; `faults` may be swapped at any time."""

    def __init__(
        self, layout: KVLayout, k_caches, v_caches, *, faults: FaultPlan | None = None
    ) -> None:
        super().__init__(layout, k_caches, v_caches)
        self.faults = faults or FaultPlan()

    def _check_endpoint(self, endpoint: str) -> None:
        if not endpoint.startswith("inproc://"):
            raise ValueError(f"bad KV endpoint {endpoint!r}: expected inproc://NAME")

    def _connect(self, endpoint: str) -> Link:
        with _ENDPOINTS_LOCK:
            receiver = _ENDPOINTS.get(endpoint)
        if receiver is None:
            raise ConnectionError(f"no in-process KV receiver at {endpoint} (not started?)")
        if self.faults.fail_handshake:
            raise HandshakeRefused("injected fault: the receiver refused the handshake")
        receiver._handshake(self.layout)
        return InprocLink(self, receiver)


class InprocReceiver(TableReceiver):
    """Receiver registered as "inproc://NAME" (a fresh unique name unless `name` is given)."""

    def __init__(
        self, layout: KVLayout, k_caches, v_caches, host: str = "127.0.0.1", *, name=None
    ) -> None:
        super().__init__(layout, k_caches, v_caches)
        self._endpoint = f"inproc://{name or uuid.uuid4().hex}"

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def start(self) -> None:
        with _ENDPOINTS_LOCK:
            if self._endpoint in _ENDPOINTS:
                raise ValueError(f"{self._endpoint} is already taken by another receiver")
            _ENDPOINTS[self._endpoint] = self

    def _handshake(self, layout: KVLayout) -> None:
        try:
            self.layout.check_compatible(layout, mine="decode worker", theirs="prefill worker")
            if self.layout.tp_size != 1 or layout.tp_size != 1:
                raise KVLayoutMismatch(
                    "the inproc connector moves the blocks of one rank to one rank; KV of "
                    "tensor-parallel groups moves over tcp or nixl"
                )
        except ValueError:
            self._stats.add(failures=1)
            raise

    def _deliver(self, job: Job, sender: InprocSender, corrupt: bool) -> str | None:
        """Copy one layer from the sender's caches into registered blocks (or refuse it)."""
        ticket = self._table.begin_write(job.transfer_id, job.layer, job.dst_ids)
        if isinstance(ticket, str):
            return ticket
        t0 = time.perf_counter()
        runs = paired_runs(job.src_ids, job.dst_ids)
        pairs = zip(
            layer_caches(sender.k_caches, sender.v_caches, job.layer),
            layer_caches(self.k_caches, self.v_caches, job.layer),
            layer_caches(self._k_bytes, self._v_bytes, job.layer),
            strict=True,
        )  # K and V, or the latent
        for src, dst, dst_bytes in pairs:
            for r in runs:
                if ticket.released:
                    break
                dst[r.dst : r.dst + r.count].copy_(src[r.src : r.src + r.count])
                if corrupt:
                    dst_bytes[r.dst : r.dst + r.count, 0] ^= 0xFF
        nbytes = sender._payload_bytes(len(job.src_ids))
        return self._table.end_write(ticket, None, nbytes, time.perf_counter() - t0)

    def close(self) -> None:
        with _ENDPOINTS_LOCK:
            if _ENDPOINTS.get(self._endpoint) is self:
                del _ENDPOINTS[self._endpoint]
