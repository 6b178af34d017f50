"""The receivers of a tensor-parallel decode group, one per rank, as one `KVReceiver`.

Each rank's receiver has its own endpoint and writes only its rank's cache (its KV heads); a
transfer is registered with every rank, has landed when it has landed on every rank, and is
released from every rank. The prefill side pushes each layer to every endpoint (`endpoints`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pdserve.kv_transfer.base import KVReceiver, TransferStats


class ReceiverGroup(KVReceiver):
    def __init__(self, receivers: Sequence[KVReceiver]) -> None:
        if not receivers:
            raise ValueError("a receiver group needs at least one receiver")
        self.receivers = list(receivers)

    @property
    def endpoint(self) -> str:
        return self.receivers[0].endpoint

    @property
    def endpoints(self) -> list[str]:
        return [r.endpoint for r in self.receivers]

    def start(self) -> None:
        for r in self.receivers:
            r.start()

    def expect(self, transfer_id: str, block_ids: Sequence[int]) -> None:
        done = []
        try:
            for r in self.receivers:
                r.expect(transfer_id, block_ids)
                done.append(r)
        except BaseException:
            for r in done:  # all ranks or none
                r.release(transfer_id)
            raise

    def layers_landed(self, transfer_id: str) -> int:
        return min(r.layers_landed(transfer_id) for r in self.receivers)

    def wait_layer(self, transfer_id: str, layer: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all(
            r.wait_layer(transfer_id, layer, max(0.0, deadline - time.monotonic()))
            for r in self.receivers
        )

    def failed(self, transfer_id: str) -> str | None:
        for rank, r in enumerate(self.receivers):
            if (error := r.failed(transfer_id)) is not None:
                return f"tensor-parallel rank {rank}: {error}"
        return None

    def release(self, transfer_id: str) -> None:
        for r in self.receivers:
            r.release(transfer_id)

    def stats(self) -> TransferStats:
        parts = [r.stats() for r in self.receivers]
        return TransferStats(
            **{f: sum(getattr(p, f) for p in parts) for f in TransferStats.__dataclass_fields__}
        )

    def close(self) -> None:
        for r in self.receivers:
            r.close()
