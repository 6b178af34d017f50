"""RouterCore: the control plane. Keeps the worker registry and the live requests, detects
dead workers, and relays the KV handoff; `placement` and `admission` decide, this acts.

Lifecycle of a remote-prefill request (numbers as in docs/architecture.md):
  submit -> Admit(remote) to D -> Placement from D -> Prefill to P -> PrefillDone from P
  (first token to the client) -> KVReady to D -> Tokens from D ... -> finished.
A local request is Admit(remote=False) to D, then Tokens.

Over 300 lines on purpose: one class over one state (the worker registry and the live
requests, which nearly every handler reads together); each handler is small, and splitting
them across files would only pass that state around.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import time

from pdserve import tracing
from pdserve.kv_transfer.layout import KVLayoutMismatch
from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams
from pdserve.router import admission, metrics, placement
from pdserve.router.config import RouterConfig
from pdserve.router.control import Channel, ControlSocket
from pdserve.router.placement import ClusterView, NoWorker
from pdserve.router.state import RequestState, WorkerInfo

log = logging.getLogger("pdserve.router")
MAX_MIGRATIONS = 3  # a request whose decode worker fails more often than this fails


class RouterCore:
    def __init__(
        self, config: RouterConfig, secret: bytes | None = None, channel: Channel | None = None
    ):
        self.config = config
        self.channel = channel or ControlSocket(config.control_host, config.control_port, secret)
        self.endpoint = self.channel.endpoint
        self.workers: dict[str, WorkerInfo] = {}
        self.requests: dict[str, RequestState] = {}
        self.refused: dict[str, str] = {}  # worker id -> why its registration was refused
        # Block hashes the shared KV store holds, as workers report them: added when a worker's
        # put or load shows the store holds a block, dropped when the store reports evicting
        # it. A stale entry only means the decode worker computes more than expected.
        self.store_index: set[int] = set()
        # unique across routers sharing workers (active-active), and across restarts
        self._prefix = f"r{secrets.token_hex(3)}-"
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self.expected = (0, 1)  # (prefill, decode-capable) workers to register before `ready`
        self.started = False  # they all have, once
        self._reset_at: dict[str, float] = {}  # worker id -> when it was last sent Reset

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._monitor())]

    async def stop(self) -> None:
        for w in self.workers.values():
            self.send(w.worker_id, m.Shutdown())
        for t in self._tasks:
            t.cancel()
        self.channel.close()

    def send(self, worker_id: str, msg) -> bool:
        return self.channel.send(worker_id, msg)

    async def _recv_loop(self) -> None:
        while True:
            wid, msg = await self.channel.recv()
            try:
                self.handle(wid, msg)
            except Exception:
                log.exception("router failed to handle %s", type(msg).__name__)

    def handle(self, wid: str, msg: m.Message) -> None:
        """Act on one message from worker socket `wid`."""
        match msg:
            case m.Register():
                self.on_register(wid, msg)
            case m.Heartbeat():
                self.on_heartbeat(wid, msg)
            case m.Placement():
                self.on_placement(wid, msg)
            case m.PrefillDone():
                self.on_prefill_done(wid, msg)
            case m.Tokens():
                self.on_tokens(wid, msg)
            case m.Failed():
                self.on_failed(msg)
            case m.Draining() | m.Leaving():
                self.on_drain(wid, msg)
            case _:  # router-to-worker messages: a worker never sends them
                log.warning("ignored %s from %s", type(msg).__name__, wid)

    # -- workers ---------------------------------------------------------------------------
    def on_register(self, wid: str, msg: m.Register) -> None:
        if (why := self._refusal(wid, msg)) is not None:  # no restart fixes it: it exits 78
            log.error("refused worker %s: %s", wid, why)
            metrics.KV_FAILURES_BY_CAUSE.labels("layout_refused").inc()
            self.refused[wid] = why
            self.send(wid, m.RegisterAck(False, why))
            return
        self.refused.pop(wid, None)
        old = self.workers.get(wid)
        if old is not None and old.alive:
            self.worker_lost(old, "it re-registered (restarted)")
        self.workers[wid] = WorkerInfo(
            wid, msg.role, msg.layout, msg.kv_endpoint, msg.total_blocks, msg.max_model_len,
            msg.pid, has_store=msg.has_store, cached=set(msg.cached), placement=msg.placement,
            kv_compression=msg.kv_compression, kv_transport=msg.kv_transport,
        )  # fmt: skip
        self.send(wid, m.RegisterAck(True))
        log.info("worker %s registered as %s", wid, msg.role)
        self.started = self.started or self.has_workers(*self.expected)

    def _refusal(self, wid: str, msg: m.Register) -> str | None:
        """Why a worker registering cannot join the live ones (None: it can): a KV layout
        another worker cannot take, or, between a prefill and a decode worker, another KV
        transport (a tcp push cannot reach a NIXL receiver: every request would time out
        and be prefilled again on the decode worker)."""
        for other in self.alive():
            if other.worker_id == wid:
                continue
            try:
                other.layout.check_compatible(msg.layout, mine=other.worker_id, theirs=wid)
            except KVLayoutMismatch as exc:
                return str(exc)
            if {msg.role, other.role} == {"prefill", "decode"} and (
                msg.kv_transport != other.kv_transport
            ):
                return (
                    f"{msg.role} worker {wid} moves KV over {msg.kv_transport}, but "
                    f"{other.role} worker {other.worker_id} moves it over "
                    f"{other.kv_transport}: prefill and decode workers must use one "
                    f"--kv-transport; start {wid} with --kv-transport {other.kv_transport}"
                )
        return None

    def on_heartbeat(self, wid: str, msg: m.Heartbeat) -> None:
        if wid.partition("#")[0] != msg.worker_id:
            return  # not from that worker's heartbeat socket "<id>#hb"
        w, now = self.workers.get(msg.worker_id), time.monotonic()
        if w is None or not w.alive:
            # Stalled past its timeout, or registered with a router that is gone (this one
            # restarted on its address): make it drop stale work and register here.
            if now - self._reset_at.get(msg.worker_id, 0.0) > 1.0:
                self._reset_at[msg.worker_id] = now
                self.send(msg.worker_id, m.Reset())
            return
        w.last_seen = now
        self.send(msg.worker_id, m.RouterBeat())
        if msg.load is not None:
            before = w.load.leases_expired if w.load is not None else 0
            expired = msg.load.leases_expired - before
            if expired < 0:  # its counter restarted with it
                expired = msg.load.leases_expired
            if expired:
                metrics.KV_FAILURES_BY_CAUSE.labels("lease_expired").inc(expired)
            w.load, w.load_at = msg.load, now
        w.cached.difference_update(msg.removed)
        w.cached.update(msg.stored)
        self.store_index.update(msg.offloaded)
        self.store_index.difference_update(msg.store_removed)  # disjoint from offloaded

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.check_liveness(time.monotonic())

    def check_liveness(self, now: float) -> None:
        """Declare lost every live worker silent for longer than the heartbeat timeout."""
        for w in self.alive():
            if now - w.last_seen > self.config.heartbeat_timeout_s:
                self.worker_lost(w, f"no heartbeat for {now - w.last_seen:.1f}s")

    def on_drain(self, wid: str, msg: m.Draining | m.Leaving) -> None:
        w = self.workers.get(msg.worker_id)
        if w is None or not w.alive or wid != msg.worker_id:
            return
        if isinstance(msg, m.Draining):
            w.draining = True
            log.info("worker %s is draining: nothing new is placed on it", wid)
        else:
            self.worker_lost(w, "it left (drained, or stopped)", failure=False)

    def worker_lost(self, w: WorkerInfo, why: str, failure: bool = True) -> None:
        """Stop routing to w; migrate or re-prefill every request it held."""
        (log.warning if failure else log.info)("worker %s lost: %s", w.worker_id, why)
        w.alive = False
        if failure:
            metrics.WORKER_FAILURES.inc()
        for rid in list(w.inflight):
            state = self.requests.get(rid)
            if state is None or state.finished:
                continue
            if state.decode_id == w.worker_id:
                self.migrate(state)
            elif state.prefill_id == w.worker_id and state.decode_id:
                self.send(state.decode_id, m.KVReady(rid, None))  # D prefills locally
        w.inflight.clear()

    def migrate(self, state: RequestState) -> None:
        """Replay prompt + tokens already streamed on another decode worker, which skips the
        tokens the client has (Admit.skip_tokens); fail the request if none can take it."""
        remaining = state.params.max_tokens - len(state.tokens)
        try:
            decode = placement.pick_decode(self.view(), state.prompt, self.config.block_size)
        except NoWorker:
            decode = None
        if decode is None or remaining <= 0 or state.migrations >= MAX_MIGRATIONS:
            state.fail(503, "the worker serving this request failed and no other can take it")
            return
        state.migrations += 1
        metrics.MIGRATIONS.inc()
        tracing.event(state.span, "migration", from_worker=state.decode_id,
                      to_worker=decode.worker_id, tokens_streamed=len(state.tokens))  # fmt: skip
        state.decode_id, state.prefill_id, state.remote = decode.worker_id, None, False
        decode.inflight.add(state.request_id)
        # the client has the prompt logprobs already (they came with the first token)
        params = dataclasses.replace(state.params, max_tokens=remaining, prompt_logprobs=None)
        replay = state.prompt + state.tokens
        admit = m.Admit(
            state.request_id, replay, params, False, self.config.lease_s, len(state.tokens),
            trace=state.trace,
        )  # fmt: skip
        self.send(decode.worker_id, admit)

    def alive(self, role: str | None = None) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.alive and (role is None or w.role == role)]

    def view(self) -> ClusterView:
        return ClusterView.of(self.workers.values(), self.requests.values(), self.store_index)

    def has_workers(self, prefill: int, decode: int) -> bool:
        view = self.view()
        return len(view.prefill_pool) >= prefill and len(view.decoders) >= decode

    @property
    def ready(self) -> bool:
        """Readiness (`GET /health`): every expected worker has registered once (start-up is
        over), and a decode-capable worker is up now."""
        return self.started and self.has_workers(0, 1)

    async def wait_for_workers(self, prefill: int, decode: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.has_workers(prefill, decode):
                return True
            await asyncio.sleep(0.1)
        return False

    @property
    def max_model_len(self) -> int | None:
        lens = [w.max_model_len for w in self.alive()]
        return min(lens) if lens else None

    # -- requests --------------------------------------------------------------------------
    def submit(
        self, prompt: list[int], params: SamplingParams, near: str | None = None, span=None
    ) -> RequestState:
        """Place a validated request; its events arrive on the returned state's queue.
        `near`: the decode worker where a request with the same prompt got its first token
        (n > 1): this one goes there and uses the KV it holds (`placement.place`). `span`: its
        request span when traced (the placement span goes under it, its workers' too).
        Raises Overloaded (admission refused it) or NoWorker (nobody can take it)."""
        began = time.monotonic()
        admission.check_capacity(self.config, len(self.requests))
        view = self.view()
        choice = placement.place(self.config, view, prompt, near)
        admission.check_slo(self.config, view, choice.decode, choice.remote, choice.uncached)
        metrics.CACHE_TEMPERATURE.labels("warm" if choice.warm else "cold").inc()
        metrics.PREFILL_DECISIONS.labels("remote" if choice.remote else "local").inc()
        state = RequestState(
            f"{self._prefix}{next(self._ids)}",
            prompt,
            params,
            choice.remote,
            decode_id=choice.decode.worker_id,
            warm=choice.warm,
            uncached_tokens=choice.uncached,
        )
        if span is not None:
            state.span, state.trace = span, tracing.traceparent(span)
            tracing.end(
                tracing.start("placement", span, began),
                decode_worker=choice.decode.worker_id, remote_prefill=choice.remote,
                why=choice.why, warm=choice.warm, uncached_tokens=choice.uncached,
                cached_tokens=len(prompt) - choice.uncached,
            )  # fmt: skip
        admit = m.Admit(
            state.request_id, prompt, params, choice.remote, self.config.lease_s,
            trace=state.trace,
        )  # fmt: skip
        if not self.send(choice.decode.worker_id, admit):
            raise NoWorker("the decode worker could not be reached")
        self.requests[state.request_id] = state
        choice.decode.inflight.add(state.request_id)
        return state

    def finish(self, state: RequestState, abort: bool) -> None:
        """Forget a request; with abort, tell every worker holding it to free its blocks."""
        self.requests.pop(state.request_id, None)
        if abort:
            tracing.event(state.span, "abort")
        for wid in (state.decode_id, state.prefill_id):
            w = self.workers.get(wid) if wid else None
            if w is None:
                continue
            w.inflight.discard(state.request_id)
            if abort and w.alive:
                self.send(wid, m.Abort(state.request_id))

    def on_placement(self, wid: str, msg: m.Placement) -> None:
        """D holds blocks for the KV: have a prefill worker compute and push it there."""
        state = self.requests.get(msg.request_id)
        if state is None:
            self.send(wid, m.Abort(msg.request_id))
            return
        prefill = placement.pick_prefill(self.view(), state.prompt, self.config.block_size)
        if prefill is None:
            tracing.event(state.span, "fallback_local_prefill", why="no prefill worker")
            self.send(wid, m.KVReady(msg.request_id, None))  # prefill locally on D
            return
        state.prefill_id = prefill.worker_id
        state.placed_at = time.monotonic()
        state.cached_tokens = msg.num_cached_tokens
        prefill.inflight.add(state.request_id)
        self.send(
            prefill.worker_id,
            m.Prefill(
                msg.request_id,
                state.prompt,
                state.params,
                msg.kv_endpoints,
                msg.block_ids,
                msg.num_cached_tokens,
                trace=state.trace,
            ),
        )

    def on_prefill_done(self, wid: str, msg: m.PrefillDone) -> None:
        """P pushed every layer (or failed): the first token goes to the client and D joins
        the request to its batch; after a failure D prefills the prompt itself."""
        state = self.requests.get(msg.request_id)
        w = self.workers.get(wid)
        if w is not None:
            w.inflight.discard(msg.request_id)
        if state is None:
            return
        fp8 = w is not None and w.kv_compression == "fp8"
        metrics.observe_prefill_done(msg, "fp8" if fp8 else "raw", state.placed_at)
        state.prefill_done_at, state.prefill_report = time.monotonic(), msg
        if msg.first_token is None:
            log.warning("prefill of %s failed (%s): decode worker prefills locally",
                        msg.request_id, msg.error)  # fmt: skip
            tracing.event(state.span, "fallback_local_prefill", why=msg.error)
            self.send(state.decode_id, m.KVReady(msg.request_id, None))
            return
        # D reports whether it also ends the request
        state.deliver(0, msg.first_token, None, msg.logprobs, msg.prompt_logprobs)
        self.send(state.decode_id, m.KVReady(msg.request_id, msg.first_token))

    def on_tokens(self, wid: str, msg: m.Tokens) -> None:
        """Tokens from the request's current decode worker only (not from one it left)."""
        for item in msg.items:
            state = self.requests.get(item.request_id)
            if state is not None and state.decode_id == wid:
                state.deliver(
                    item.index, item.token, item.finish_reason, item.logprobs, item.prompt_logprobs
                )

    def on_failed(self, msg: m.Failed) -> None:
        state = self.requests.get(msg.request_id)
        if state is not None:
            state.fail(msg.status, msg.error)
