"""The prefill side of a worker (role prefill): computes prompts and pushes each layer's KV
into the decode worker's blocks as soon as that layer's forward pass ends.

It is the engine's KV connector: `after_layer` queues the layer's blocks each prompt completed
in the step (a long prompt is computed in chunks, `config.WORKER_CHUNK_SIZE` by default, each
chunk's blocks pushed under the next chunks, and an Abort read between them stops it), and
`request_finished` keeps a finished prompt's blocks held until the push is acknowledged
(`settle`), when the router gets PrefillDone with the first token. Pushes are awaited without
blocking the loop: a decode worker that stops reading costs its own requests the transfer
timeout, never the other prompts queued here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve import tracing
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.llm_engine import LLMEngine, StepOutput
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer.base import KVSender
from pdserve.protocol import messages as m
from pdserve.serving.decode_side import prompt_logprobs, to_sampling
from pdserve.serving.kv_staging import HostStaging

PUSH_GRACE_S = 0.2  # how long a step's end waits for its pushes before the next step


@dataclass
class Outgoing:
    request_id: str
    endpoints: list[str]  # of the decode worker's ranks: each is sent its own KV heads
    dst_block_ids: list[int]
    first_block: int
    started: float = field(default_factory=time.monotonic)
    scheduled: float = 0.0  # when its first chunk was scheduled (0: still queued)
    trace: str = ""  # the router's traceparent: its phases are recorded as spans (tracing.py)
    chunks: int = 0  # steps that computed part of it
    pushed: float = 0.0  # when its first layer was queued on the sender
    sent: list[int] = field(default_factory=list)  # per layer: the blocks before this are queued
    done: StepOutput | None = None  # the prompt is computed; its push awaits acknowledgement
    computed: float = 0.0  # when; its push is given up transfer_timeout_s later


class PrefillSide(KVConnector):
    def __init__(
        self,
        engine: LLMEngine,
        sender: KVSender,
        send: Callable[[object], None],
        transfer_timeout_s: float,
        staging: HostStaging | None = None,
        whole: bool = False,
    ):
        self.engine, self.sender, self.send = engine, sender, send
        self.transfer_timeout_s, self.staging = transfer_timeout_s, staging
        self.whole = whole  # --kv-push whole: every layer once the last one is computed
        self.last_layer = engine.model_config.num_layers - 1
        self.block_size = engine.config.block_size
        self.outgoing: dict[str, Outgoing] = {}  # request -> push destination
        self.pushing: dict[str, Outgoing] = {}  # computed, push not yet acknowledged

    @property
    def request_ids(self) -> set[str]:
        return set(self.outgoing) | set(self.pushing)

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
            seq.request_id, msg.kv_endpoints, msg.dst_block_ids, first,
            trace=msg.trace if tracing.enabled() else "", sent=[first] * (self.last_layer + 1),
        )  # fmt: skip

    # -- KVConnector -----------------------------------------------------------------------
    def wants_layers(self, batch: ScheduledBatch) -> bool:
        if not self.outgoing:
            return False
        now = None
        for seq in batch.seqs:  # the step that schedules a prompt's first chunk ends its queue
            out = self.outgoing.get(seq.request_id)
            if out is not None:
                out.chunks += 1
                if not out.scheduled:
                    out.scheduled = now = now or time.monotonic()
        return True

    def after_layer(self, batch: ScheduledBatch, layer: int) -> None:
        """Queue layer `layer`'s KV of the blocks each prompt completed in this step: a chunk's
        whole blocks at once, so the push runs under the next chunks (the last chunk adds the
        partial block at the end), and what a layer has not sent yet. A step that recomputes
        tokens already sent (a prefix load fell short) sends their blocks again. With
        `whole`, every layer's blocks go after the last layer of the prompt's last step."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            out = self.outgoing.get(seq.request_id)
            if out is None:
                continue
            end = seq.num_computed_tokens + n
            if self.whole:
                if end >= seq.num_tokens and layer == self.last_layer:
                    for each in range(self.last_layer + 1):
                        self._queue(seq, out, each, out.first_block, len(out.dst_block_ids))
                continue
            stop = len(out.dst_block_ids) if end >= seq.num_tokens else end // self.block_size
            redo = max(out.first_block, seq.num_computed_tokens // self.block_size)
            start = min(out.sent[layer], redo)
            self._queue(seq, out, layer, start, stop)

    def _queue(self, seq: Sequence, out: Outgoing, layer: int, start: int, stop: int) -> None:
        """Queue layer `layer`'s blocks [start, stop) of `seq` for each of its endpoints."""
        if stop <= start:
            return
        if not out.pushed:
            out.pushed = time.monotonic()
        src = seq.block_table[start:stop]
        if self.staging is not None:
            src = self.staging.to_host(seq.request_id, layer, src, start - out.first_block)
        dst = out.dst_block_ids[start:stop]
        for endpoint in out.endpoints:
            self.sender.send_layer(endpoint, seq.request_id, layer, src, dst)
        out.sent[layer] = stop

    def request_finished(self, seq: Sequence) -> bool:
        return seq.request_id in self.outgoing  # held until its push is acknowledged

    # -- after the step --------------------------------------------------------------------
    def finish(self, outs: list[StepOutput]) -> None:
        """The prompts just computed wait for their pushes' acknowledgements (`settle`). The
        last layers are usually acknowledged within milliseconds: wait up to PUSH_GRACE_S for
        them before the next step (whose prompts would otherwise delay this first token)."""
        now = time.monotonic()
        done = []
        for o in outs:
            out = self.outgoing.pop(o.seq.request_id, None)
            if out is not None:
                out.done, out.computed = o, now
                self.pushing[o.seq.request_id] = out
                done.append(o.seq.request_id)
        grace = now + PUSH_GRACE_S
        while not all(map(self.sender.settled, done)) and time.monotonic() < grace:
            self.sender.wait_change(grace - time.monotonic())
        self.settle()

    def settle(self) -> None:
        """Report every push that ended (acknowledged, failed, or past the transfer timeout):
        free its blocks and send PrefillDone with the first token (None if the push failed)."""
        now = time.monotonic()
        for rid, out in list(self.pushing.items()):
            if self.sender.settled(rid):
                res = self.sender.wait(rid, 0.0)
            elif now >= out.computed + self.transfer_timeout_s:
                res = self.sender.cancel(
                    rid, f"timed out after {self.transfer_timeout_s:g} s: the decode worker did "
                    "not acknowledge every layer (--transfer-timeout-s)",
                )  # fmt: skip
                # a receiver that stopped reading stalls everything behind on that connection
                for endpoint in out.endpoints:
                    self.sender.close_endpoint(endpoint)
            else:
                continue
            del self.pushing[rid]
            self._release(rid)
            o = out.done
            if out.trace:
                self.trace(out, res, now)
            self.send(
                m.PrefillDone(
                    rid,
                    o.new_token if res.ok else None,
                    error=res.error,
                    transfer_bytes=res.bytes_sent,
                    transfer_s=res.seconds,
                    prefill_s=now - out.started,
                    exposed_s=now - out.computed,
                    queue_s=(out.scheduled or out.computed) - out.started,
                    compute_s=out.computed - (out.scheduled or out.computed),
                    logprobs=m.Logprobs.of(o.logprobs),
                    prompt_logprobs=prompt_logprobs(o.seq),
                )
            )

    def trace(self, out: Outgoing, res, now: float) -> None:
        """A traced request's phases here as spans: queue, compute, kv_push."""
        scheduled = out.scheduled or out.computed
        tracing.record("prefill.queue", out.trace, out.started, scheduled,
                       request_id=out.request_id)  # fmt: skip
        seq = out.done.seq
        tracing.record(
            "prefill.compute", out.trace, scheduled, out.computed, request_id=out.request_id,
            prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
            chunks=out.chunks,
        )  # fmt: skip
        failed = () if res.ok else (("kv_push_failed", now, {"error": res.error}),)
        tracing.record(
            "prefill.kv_push", out.trace, out.pushed or out.computed, now, failed,
            request_id=out.request_id, bytes=res.bytes_sent, seconds=res.seconds,
            layers=self.engine.model_config.num_layers, exposed_s=now - out.computed,
            blocks=len(out.dst_block_ids) - out.first_block, destinations=len(out.endpoints),
            transport=type(self.sender).__name__, ok=res.ok,
            encoding=getattr(self.sender, "encoding", "raw"),
        )  # fmt: skip

    def wait_settle(self, timeout_s: float) -> None:
        """Idle loop: sleep until a push makes progress (or the timeout), then settle."""
        if self.pushing:
            self.sender.wait_change(timeout_s)
            self.settle()

    def _release(self, rid: str) -> None:
        self.engine.release(rid)
        if self.staging is not None:
            self.staging.release(rid)

    def abort(self, rid: str) -> None:
        """Before the engine frees rid's blocks (`Worker.abort`: the sides first): its transfer
        is cancelled, so the sender stops reading them, whether the prompt was computed
        (pushing) or is between chunks with layers already queued (outgoing)."""
        computing = self.outgoing.pop(rid, None)
        pushed = self.pushing.pop(rid, None)
        if computing is not None or pushed is not None:
            self.sender.cancel(rid, "request aborted")
        if pushed is not None:  # held after the engine finished it: freed here
            self._release(rid)
        elif self.staging is not None:
            self.staging.release(rid)
