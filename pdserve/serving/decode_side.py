"""The decode side of a worker (roles decode and both): requests the router admits, the KV
leases of those prefilled elsewhere, and the tokens it streams back.

It is the engine's KV connector for remote KV: when the engine gives a remote-prefill request
blocks (`on_allocate`), it registers them with the KV receiver.

Queues:  pending (no blocks yet) -> transferring (blocks under a lease, KV arriving)
         -> running -> finished
A remote-prefill request gets blocks as soon as the engine has them (oldest first) and the
router is told where the KV must land (Placement); when the prefill worker reports every layer
pushed (KVReady with the first token) it joins the running batch. A lease that expires, or KV
that arrives incomplete, makes this worker prefill the prompt itself: slower, nothing lost. A
request replayed here after its decode worker failed (migration) numbers its tokens after
the ones the client already has.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve import tracing
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.llm_engine import LLMEngine, StepOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer import KVLayout
from pdserve.kv_transfer.base import KVReceiver
from pdserve.protocol import messages as m
from pdserve.serving.kv_staging import HostStaging

log = logging.getLogger("pdserve.worker")


def to_sampling(p: SamplingParams, **overrides) -> SamplingParams:
    """The engine's params for a request: the message's own (one type), with `overrides`."""
    return dataclasses.replace(p, **overrides) if overrides else p


def prompt_logprobs(seq: Sequence) -> list[m.Logprobs] | None:
    """The prompt logprobs this worker computed for seq (sent once, with its first token)."""
    return [m.Logprobs.of(lp) for lp in seq.prompt_logprobs] or None


@dataclass
class Traced:
    """A traced request's times here (pdserve/tracing.py): its phases become spans under the
    router's `trace` as they end: decode.kv_wait (remote prefill: admitted -> its KV landed),
    decode.first_token (-> the first token this worker computed: the prompt prefilled here,
    or the first decode step after the KV landed), decode.decode (-> its last token)."""

    trace: str
    admitted: float
    remote: bool
    skip_tokens: int  # > 0: replayed here after its decode worker failed (migration)
    kv_ready: float = 0.0
    first: float = 0.0
    events: list = field(default_factory=list)  # (name, at, attrs) of the phase in progress


class DecodeSide(KVConnector):
    def __init__(
        self,
        engine: LLMEngine,
        layout: KVLayout,
        send: Callable[[object], None],
        worker_id: str,
        receiver: KVReceiver | None = None,  # None: role both, every prompt prefilled here
        staging: HostStaging | None = None,
    ):
        self.engine, self.layout, self.send, self.worker_id = engine, layout, send, worker_id
        self.receiver, self.staging = receiver, staging
        self.pending: list[m.Admit] = []  # waiting for free blocks, oldest first
        self.leases: dict[str, float] = {}  # request -> deadline for its KV
        self.index_offset: dict[str, int] = {}  # tokens streamed before this worker took over
        self.landing: dict[str, list[int]] = {}  # request -> the blocks its pushed KV lands in
        self.leases_expired = 0  # since it started (heartbeats; the router counts them)
        self.traced: dict[str, Traced] = {}  # requests the router traces
        self.store = None  # its KV store link, when traces report store hits (build.py)

    @property
    def request_ids(self) -> set[str]:
        return {*self.leases, *(a.request_id for a in self.pending)}

    def has_waiting(self) -> bool:
        return bool(self.pending or self.leases)

    def on_admit(self, msg: m.Admit) -> None:
        self.index_offset[msg.request_id] = msg.skip_tokens
        remote = msg.remote_prefill and self.receiver is not None
        if msg.trace and tracing.enabled():
            self.traced[msg.request_id] = Traced(
                msg.trace, time.monotonic(), remote, msg.skip_tokens
            )
        if remote:
            self.pending.append(msg)
            self.try_place()
        else:
            self.engine.add_request(
                msg.prompt, to_sampling(msg.params), msg.request_id, msg.skip_tokens
            )

    def try_place(self) -> None:
        """Give pending remote-prefill requests blocks, oldest first, and answer Placement."""
        bs = self.layout.block_size
        while self.pending:
            admit = self.pending[0]
            # the most host blocks it can need (its cached prefix is known once it has blocks)
            if self.staging is not None and self.staging.num_free < -(-len(admit.prompt) // bs):
                return
            seq = self.engine.make_sequence(
                admit.prompt, to_sampling(admit.params), admit.request_id, admit.skip_tokens
            )
            if not self.engine.add_transferring(seq):  # -> on_allocate registers the blocks
                return
            self.pending.pop(0)
            self.leases[seq.request_id] = time.monotonic() + admit.lease_s
            first = seq.num_cached_tokens // bs
            dst = self.landing[seq.request_id]
            placed = m.Placement(
                seq.request_id,
                seq.block_table[:first] + dst,
                seq.num_cached_tokens,
                self.receiver.endpoints,
            )
            self.send(placed)

    # -- KVConnector -----------------------------------------------------------------------
    def on_allocate(self, seq: Sequence, under_step: bool) -> None:
        """Blocks for a prompt whose KV another worker pushes (not `under_step`: no step here
        computes it): register those after its cached prefix with the receiver, or the host
        blocks the KV lands in first on a GPU worker. A local prefill moves no KV here."""
        if under_step or self.receiver is None:
            return
        first = seq.num_cached_tokens // self.layout.block_size
        dst = seq.block_table[first:]
        if self.staging is not None:  # the KV lands in host blocks (checked free in try_place)
            dst = self.staging.take(seq.request_id, len(dst))
        self.receiver.expect(seq.request_id, dst)
        self.landing[seq.request_id] = dst

    def on_kv_ready(self, msg: m.KVReady) -> None:
        """The prefill worker is done: join the batch if every layer landed intact, else
        prefill the prompt here."""
        rid = msg.request_id
        self.landing.pop(rid, None)
        if self.leases.pop(rid, None) is None:
            return  # aborted, or its lease expired and it is computing locally
        error = self.receiver.failed(rid)
        landed = self.receiver.layers_landed(rid)
        self.receiver.release(rid)
        complete = msg.first_token is not None and not error and landed == self.layout.num_layers
        if self.staging is not None:
            if complete:
                seq = self.engine.requests[rid]
                first = seq.num_cached_tokens // self.layout.block_size
                self.staging.to_device(rid, seq.block_table[first:])
            self.staging.release(rid)
        if rid in self.traced:
            self.kv_landed(rid, landed, complete, error or ("prefill failed" if msg.first_token
                           is None else "layers missing"))  # fmt: skip
        if not complete:
            log.warning(
                "KV of %s incomplete (%s, %d layers): prefilling locally", rid, error, landed
            )
            self.engine.resume_local(rid)
            return
        out = self.engine.start_decoding(rid, msg.first_token)
        if out is not None:
            self.emit([out])

    def expire_leases(self, now: float) -> None:
        for rid, deadline in list(self.leases.items()):
            if now > deadline:
                log.warning("lease of %s expired before its KV arrived: prefilling locally", rid)
                del self.leases[rid]
                self.leases_expired += 1
                if rid in self.traced:
                    self.kv_landed(rid, self.receiver.layers_landed(rid), False, "lease expired")
                self.landing.pop(rid, None)
                self.receiver.release(rid)
                if self.staging is not None:
                    self.staging.release(rid)
                self.engine.resume_local(rid)

    def emit(self, outs: list[StepOutput]) -> None:
        """Stream tokens to the router, numbered from the start of the client's output."""
        items = []
        for o in outs:
            rid = o.seq.request_id
            index = self.index_offset.get(rid, 0) + o.num_output_tokens - 1
            first = o.num_output_tokens == 1
            items.append(
                m.TokenOut(
                    rid,
                    index,
                    o.new_token,
                    o.seq.finish_reason if o.finished else None,
                    m.Logprobs.of(o.logprobs),
                    prompt_logprobs(o.seq) if first else None,
                )
            )
            if o.finished:
                self.index_offset.pop(rid, None)
            if self.traced and rid in self.traced:
                self.trace_token(o)
            elif o.finished and self.store is not None:
                self.store.lookups.pop(rid, None)
        if items:
            self.send(m.Tokens(self.worker_id, items))

    # -- tracing ---------------------------------------------------------------------------
    def kv_landed(self, rid: str, landed: int, complete: bool, why: str) -> None:
        """decode.kv_wait of a traced request ends (its KV landed, or it prefills here)."""
        t, now = self.traced[rid], time.monotonic()
        t.kv_ready = now
        events = () if complete else (("fallback_local_prefill", now, {"why": why}),)
        tracing.record("decode.kv_wait", t.trace, t.admitted, now, events, request_id=rid,
                       layers_landed=landed, complete=complete)  # fmt: skip
        if not complete:
            t.remote = False

    def trace_token(self, o: StepOutput) -> None:
        t, now, seq = self.traced[o.seq.request_id], time.monotonic(), o.seq
        rid = seq.request_id
        if not t.first:
            t.first = now
            events = ()
            if self.store is not None and rid in self.store.lookups:
                queried, held = self.store.lookups.pop(rid)
                kind = "kv_store_hit" if held else "kv_store_miss"
                events = ((kind, t.kv_ready or t.admitted, {"queried_tokens": queried,
                                                            "hit_tokens": held}),)  # fmt: skip
            tracing.record(
                "decode.first_token", t.trace, t.kv_ready or t.admitted, now, events,
                request_id=rid,
                local_prefill=not t.remote, cached_tokens=seq.num_cached_tokens,
                prompt_tokens=seq.num_prompt_tokens, migrated_after=t.skip_tokens or None,
            )  # fmt: skip
        if o.finished:
            del self.traced[rid]
            tracing.record("decode.decode", t.trace, t.first, now, request_id=rid,
                           output_tokens=seq.num_output_tokens,
                           preemptions=seq.num_preemptions,
                           finish_reason=seq.finish_reason)  # fmt: skip

    def trace_abort(self, rid: str) -> None:
        t, now = self.traced.pop(rid), time.monotonic()
        name = "decode.decode" if t.first else "decode.first_token" if t.kv_ready else (
            "decode.kv_wait")  # fmt: skip
        start = t.first or t.kv_ready or t.admitted
        tracing.record(name, t.trace, start, now, (("abort", now, {}),), request_id=rid)

    def abort(self, rid: str) -> None:
        """Forget rid here (the engine's own abort is the caller's)."""
        if rid in self.traced:
            self.trace_abort(rid)
        if self.store is not None:
            self.store.lookups.pop(rid, None)
        self.pending = [a for a in self.pending if a.request_id != rid]
        self.leases.pop(rid, None)
        self.landing.pop(rid, None)
        if self.receiver is not None:
            self.receiver.release(rid)  # no byte lands in these blocks after this
        if self.staging is not None:
            self.staging.release(rid)
        self.index_offset.pop(rid, None)
