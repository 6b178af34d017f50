"""The senders of a pipeline-parallel prefill worker, one per stage, as one `KVSender`.

Each stage's layers go over that stage's own sender: its own connection to each decode rank
(tcp), its own NIXL agent (nixl), so the stages' pushes do not queue behind each other and each
stage sends exactly its layers' bytes (`stage_stats`). Stage 0's sender is in stage 0's
process; each later stage's is in that stage's own, driven through a `StageLink`
(`stage_link.py`). A transfer has ended when it has ended
on every stage's sender; the receiver counts it complete when every layer has landed, whichever
connection it came over. The prefill side sees one sender (`PrefillSide` is unchanged).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pdserve.kv_transfer.base import KVSender, TransferResult, TransferStats


class StageSenders(KVSender):
    """`senders[s]` sends the layers of `layers[s]` (stage s's, `engine/pp/stages.py`)."""

    def __init__(self, senders: Sequence[KVSender], layers: Sequence[range]) -> None:
        if len(senders) != len(layers) or not senders:
            raise ValueError(f"one sender per stage: {len(senders)} for {len(layers)} stages")
        self.senders, self.layers = list(senders), list(layers)
        self._stage = {layer: s for s, held in enumerate(layers) for layer in held}

    @property
    def encoding(self) -> str:
        return getattr(self.senders[0], "encoding", "raw")

    def send_layer(self, dest_endpoint, transfer_id, layer, src_block_ids, dst_block_ids) -> None:
        if layer not in self._stage:
            raise ValueError(f"layer {layer} is held by no pipeline stage ({self.layers})")
        sender = self.senders[self._stage[layer]]
        sender.send_layer(dest_endpoint, transfer_id, layer, src_block_ids, dst_block_ids)

    def wait(self, transfer_id: str, timeout_s: float) -> TransferResult:
        deadline = time.monotonic() + timeout_s
        results = [s.wait(transfer_id, max(0.0, deadline - time.monotonic())) for s in self.senders]
        return _combined(results)

    def settled(self, transfer_id: str) -> bool:
        # every sender asked (no short cut): a stage's link seals the transfer when first asked
        return all([s.settled(transfer_id) for s in self.senders])

    def wait_change(self, timeout_s: float) -> None:
        # each sender in turn for its share of the time: a change on another one is seen
        # within that share (callers poll `settled` after each return)
        for s in self.senders:
            s.wait_change(timeout_s / len(self.senders))

    def cancel(self, transfer_id: str, reason: str) -> TransferResult:
        return _combined([s.cancel(transfer_id, reason) for s in self.senders])

    def close_endpoint(self, endpoint: str) -> None:
        for s in self.senders:
            s.close_endpoint(endpoint)

    def stage_stats(self) -> list[TransferStats]:
        """Each stage's counters, in stage order (its bytes: exactly its layers' share)."""
        return [s.stats() for s in self.senders]

    def stats(self) -> TransferStats:
        """Every stage's counters summed (a transfer ends once on each stage's sender)."""
        parts = self.stage_stats()
        return TransferStats(
            **{f: sum(getattr(p, f) for p in parts) for f in TransferStats.__dataclass_fields__}
        )

    def close(self) -> None:
        for s in self.senders:
            s.close()


def _combined(results: Sequence[TransferResult]) -> TransferResult:
    """One transfer's outcome over every stage: ok when every stage's was; its bytes summed;
    its time the longest; the first stage's error, named by stage."""
    errors = [f"pipeline stage {s}: {r.error}" for s, r in enumerate(results) if not r.ok]
    return TransferResult(
        not errors,
        sum(r.bytes_sent for r in results),
        max(r.seconds for r in results),
        errors[0] if errors else None,
    )
