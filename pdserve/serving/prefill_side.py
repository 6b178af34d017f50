"""The prefill side of a worker (role prefill): computes prompts and pushes each layer's KV
into the decode worker's blocks as soon as that layer's forward pass ends.

It is the engine's KV connector: `after_layer` queues the layer's blocks of every prompt that
completes in the step, and `request_finished` keeps a finished prompt's blocks held until the
push is acknowledged (`finish`), when the router gets PrefillDone with the first token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.llm_engine import LLMEngine, StepOutput
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer.base import KVSender
from pdserve.protocol import messages as m
from pdserve.serving.decode_side import prompt_logprobs, to_sampling
from pdserve.serving.kv_staging import HostStaging


@dataclass
class Outgoing:
    request_id: str
    endpoint: str
    dst_block_ids: list[int]
    first_block: int
    started: float = field(default_factory=time.monotonic)


class PrefillSide(KVConnector):
    def __init__(
        self,
        engine: LLMEngine,
        sender: KVSender,
        send: Callable[[object], None],
        transfer_timeout_s: float,
        staging: HostStaging | None = None,
    ):
        self.engine, self.sender, self.send = engine, sender, send
        self.transfer_timeout_s, self.staging = transfer_timeout_s, staging
        self.block_size = engine.config.block_size
        self.outgoing: dict[str, Outgoing] = {}  # request -> push destination

    @property
    def request_ids(self) -> set[str]:
        return set(self.outgoing)

    def on_prefill(self, msg: m.Prefill) -> None:
        first = msg.num_cached_tokens // self.block_size
        seq = self.engine.add_request(
            msg.prompt, to_sampling(msg.params, max_tokens=1), msg.request_id
        )
        if self.staging is not None:
            if self.staging.take(msg.request_id, len(msg.dst_block_ids) - first) is None:
                # the decode worker prefills it itself: slower, nothing lost
                self.engine.abort(msg.request_id)
                self.send(m.PrefillDone(msg.request_id, None, error="prefill host staging full"))
                return
        self.outgoing[seq.request_id] = Outgoing(
            seq.request_id, msg.kv_endpoint, msg.dst_block_ids, first
        )

    # -- KVConnector -----------------------------------------------------------------------
    def wants_layers(self, batch: ScheduledBatch) -> bool:
        return bool(self.outgoing)

    def after_layer(self, batch: ScheduledBatch, layer: int) -> None:
        """Queue layer `layer`'s KV of every prompt that completes in this step."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            out = self.outgoing.get(seq.request_id)
            if out is None or seq.num_computed_tokens + n < seq.num_tokens:
                continue
            end = len(out.dst_block_ids)
            src = seq.block_table[out.first_block : end]
            if self.staging is not None:
                self.staging.to_host(seq.request_id, layer, src)
                src = self.staging.held(seq.request_id)
            self.sender.send_layer(
                out.endpoint, seq.request_id, layer, src, out.dst_block_ids[out.first_block : end]
            )

    def request_finished(self, seq: Sequence) -> bool:
        return seq.request_id in self.outgoing  # held until its push is acknowledged

    # -- after the step --------------------------------------------------------------------
    def finish(self, outs: list[StepOutput]) -> None:
        """Wait for the pushes of the prompts just computed, free their blocks, and report
        each to the router with its first token (None if the push failed)."""
        for o in outs:
            out = self.outgoing.pop(o.seq.request_id, None)
            if out is None:
                continue
            t = time.monotonic()
            res = self.sender.wait(o.seq.request_id, self.transfer_timeout_s)
            exposed = time.monotonic() - t
            self.engine.release(o.seq.request_id)
            if self.staging is not None:
                self.staging.release(o.seq.request_id)
            self.send(
                m.PrefillDone(
                    o.seq.request_id,
                    o.new_token if res.ok else None,
                    error=res.error,
                    transfer_bytes=res.bytes_sent,
                    transfer_s=res.seconds,
                    prefill_s=time.monotonic() - out.started,
                    exposed_s=exposed,
                    logprobs=m.Logprobs.of(o.logprobs),
                    prompt_logprobs=prompt_logprobs(o.seq),
                )
            )

    def abort(self, rid: str) -> None:
        self.outgoing.pop(rid, None)
        if self.staging is not None:
            self.staging.release(rid)
