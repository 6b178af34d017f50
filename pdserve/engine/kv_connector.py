"""KVConnector: the one object through which KV moves in and out of an engine's cache.

As vLLM v1's connector, it has a scheduler side, asked when blocks change hands, and a worker
side, called around the model's layers. The engine calls it at exactly these points:

scheduler side
  on_allocate(seq, under_step)  seq just got blocks: fill more of its prefix from elsewhere
                                (the KV store). With `under_step` the fill may still be landing
                                while the next step runs (it sets `seq.prefix_load`: see
                                PrefixLoader). Without it (blocks for an incoming KV transfer),
                                it must land before returning.
  on_evict(block)               a cached, unreferenced block is about to be reused while its KV
                                is still intact (copy it out). Must not raise, must not touch
                                the block manager.
  request_finished(seq) -> bool seq ended: True keeps its blocks held until `engine.release`
                                (its KV is still being sent: a prefill push, a store offload).
worker side, around one step's forward pass
  wants_layers(batch) -> bool   whether `after_layer` must run for this step (when no
                                connector wants them, a decode step may take the fused path)
  loads_layers(batch) -> bool   whether `wait_for_layer_load` must run for this step
  wait_for_layer_load(batch, l) before layer l reads the cache: block until layer l of the KV
                                loading into this step's sequences has landed (vLLM v1's
                                `wait_for_layer_load`)
  after_layer(batch, layer)     layer `layer`'s forward pass for `batch` has ended (push it).
  step_finished(batch)          the forward pass ended (or raised): every load into its blocks
    -> frozenset[int]           must have ended before this returns. Returns the ids (`id(seq)`)
                                of sequences whose step is void (a load fell short: their
                                counters were moved back to the first token that did not land).

In a pipeline-parallel engine (`engine/pp/`) the later stages' layers run in other processes:
`wait_for_layer_load` and `after_layer` for them run before stage 0 sends the step on. What a
prefill push's `after_layer` queues for a later stage's layer travels down with the step and is
sent by that stage once it has computed the layer (`kv_transfer/stage_link.py`).

A worker gives its engine one connector (`LLMEngine.connect`): a prefill worker's push, a
worker's KV store link, or several together (`MultiConnector`). An engine with none moves no KV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.block import Block
    from pdserve.engine.sequence import ScheduledBatch, Sequence


class KVConnector:
    """Moves no KV: each method is the no-op a connector overrides."""

    def on_allocate(self, seq: Sequence, under_step: bool) -> None:
        pass

    def on_evict(self, block: Block) -> None:
        pass

    def request_finished(self, seq: Sequence) -> bool:
        return False

    def wants_layers(self, batch: ScheduledBatch) -> bool:
        return False

    def after_layer(self, batch: ScheduledBatch, layer: int) -> None:
        pass

    def loads_layers(self, batch: ScheduledBatch) -> bool:
        return False

    def wait_for_layer_load(self, batch: ScheduledBatch, layer: int) -> None:
        pass

    def step_finished(self, batch: ScheduledBatch) -> frozenset[int]:
        return frozenset()


class PrefixLoader(KVConnector):
    """A connector whose `on_allocate` may start a prefix load that runs under the next step
    (`seq.prefix_load`, an engine.sequence.PrefixLoad): the model waits for each layer of it,
    and the step's end settles it."""

    def loads_layers(self, batch: ScheduledBatch) -> bool:
        return any(s.prefix_load is not None for s in batch.seqs)

    def wait_for_layer_load(self, batch: ScheduledBatch, layer: int) -> None:
        for seq in batch.seqs:
            if seq.prefix_load is not None:
                seq.prefix_load.wait_layer(layer)

    def step_finished(self, batch: ScheduledBatch) -> frozenset[int]:
        """Wait for the loads that ran under this step. A sequence whose load fell short goes
        back to the first token that did not land; its step is void, and the next step
        computes the rest, rewriting whatever the load left half-written."""
        void = set()
        for seq in batch.seqs:
            load, seq.prefix_load = seq.prefix_load, None
            if load is None:
                continue
            landed = load.finish()
            if landed < load.num_tokens:
                seq.num_computed_tokens = seq.num_cached_tokens = load.first_token + landed
                void.add(id(seq))
        return frozenset(void)


class MultiConnector(KVConnector):
    """Several connectors, each called in order. A finished request's blocks are held while any
    of them holds it; they are freed at the first `engine.release`, so at most one of them may
    hold a given request."""

    def __init__(self, connectors: list[KVConnector]):
        self.connectors = connectors

    def on_allocate(self, seq: Sequence, under_step: bool) -> None:
        for c in self.connectors:
            c.on_allocate(seq, under_step)

    def on_evict(self, block: Block) -> None:
        for c in self.connectors:
            c.on_evict(block)

    def request_finished(self, seq: Sequence) -> bool:
        return any([c.request_finished(seq) for c in self.connectors])  # each one hears of it

    def wants_layers(self, batch: ScheduledBatch) -> bool:
        return any(c.wants_layers(batch) for c in self.connectors)

    def after_layer(self, batch: ScheduledBatch, layer: int) -> None:
        for c in self.connectors:
            c.after_layer(batch, layer)

    def loads_layers(self, batch: ScheduledBatch) -> bool:
        return any(c.loads_layers(batch) for c in self.connectors)

    def wait_for_layer_load(self, batch: ScheduledBatch, layer: int) -> None:
        for c in self.connectors:
            c.wait_for_layer_load(batch, layer)

    def step_finished(self, batch: ScheduledBatch) -> frozenset[int]:
        void: set[int] = set()
        for c in self.connectors:  # each one settles its own loads, whatever the others did
            void |= c.step_finished(batch)
        return frozenset(void)


def combine(connectors: list[KVConnector]) -> KVConnector:
    """One connector for all of `connectors` (none: a connector that moves nothing)."""
    if not connectors:
        return KVConnector()
    return connectors[0] if len(connectors) == 1 else MultiConnector(connectors)
