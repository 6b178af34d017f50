"""RouterCore: the control plane. Registers workers, places requests, relays the KV handoff.

Lifecycle of a remote-prefill request (numbers as in docs/architecture.md):
  submit -> Admit(remote) to D -> Placement from D -> Prefill to P -> PrefillDone from P
  (first token to the client) -> KVReady to D -> Tokens from D ... -> finished.
A local request is Admit(remote=False) to D, then Tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import Counter
from functools import partial

import zmq
import zmq.asyncio

from pdserve.engine.block_hash import block_hashes
from pdserve.kv_transfer.base import KVLayoutMismatch
from pdserve.router import metrics
from pdserve.router.config import RouterConfig
from pdserve.router.state import RequestState, WorkerInfo
from pdserve.protocol import messages as m
from pdserve.protocol.channel import Codec

log = logging.getLogger("pdserve.router")


# Admission compares moving averages and estimates with the SLOs, and a request admitted now
# decodes beside the streams admitted after it, before the next heartbeat shows them: admit
# only with room to spare. Measured at 3x overload (benchmarks/admission.py, chat, 1 P + 1 D):
# with no headroom admitted p99s reached 2.5 s against a 2 s TTFT target and 200-250 ms against
# 200 ms TPOT; at 0.8 for both, TTFT p99 was 1.9 s and TPOT p99 201 ms (requests admitted while
# the decode batch was ramping up), hence more room for TPOT.
TTFT_HEADROOM = 0.8
TPOT_HEADROOM = 0.75


class Overloaded(Exception):
    """Admission control refused a request (the client should retry later: 429).
    `reason` labels the metric; `retry_after_s` is when admitting it is likely to work."""

    def __init__(self, message: str, reason: str = "max_inflight", retry_after_s: int = 1):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class RouterCore:
    def __init__(self, config: RouterConfig, secret: bytes | None = None):
        self.config = config
        self.codec = Codec(secret)
        self.workers: dict[str, WorkerInfo] = {}
        self.requests: dict[str, RequestState] = {}
        # Block hashes the shared KV store holds, as workers report them: added when a worker's
        # put or load shows the store holds a block, dropped when the store reports evicting
        # it. A stale entry only means the decode worker computes more than expected.
        self.store_index: set[int] = set()
        self._ids = itertools.count()
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if config.control_port:
            self.sock.bind(f"tcp://{config.control_host}:{config.control_port}")
        else:
            self.sock.bind(f"tcp://{config.control_host}:0")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._monitor())]

    async def stop(self) -> None:
        for w in self.workers.values():
            self.send(w.worker_id, m.Shutdown())
        for t in self._tasks:
            t.cancel()
        self.sock.close()

    # -- sockets ---------------------------------------------------------------------------
    def send(self, worker_id: str, msg) -> bool:
        """Queue msg for a worker. A dead or unknown peer is logged, never raised."""
        try:
            frames = self.codec.encode(msg)
            fut = self.sock.send_multipart([worker_id.encode(), *frames], flags=zmq.NOBLOCK)
        except (zmq.ZMQError, OverflowError, ValueError) as exc:
            log.warning("could not send %s to %s: %s", type(msg).__name__, worker_id, exc)
            return False
        fut.add_done_callback(partial(_log_send_error, type(msg).__name__, worker_id))
        return True

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            msg = self.codec.decode(frames[1:])
            if msg is None:
                continue
            try:
                getattr(self, f"_on_{type(msg).__name__}")(frames[0].decode(), msg)
            except Exception:
                log.exception("router failed to handle %s", type(msg).__name__)

    # -- workers ---------------------------------------------------------------------------
    def _on_Register(self, wid: str, msg: m.Register) -> None:
        for other in self.workers.values():
            if other.worker_id == wid or not other.alive:
                continue
            try:
                other.layout.check_compatible(msg.layout, mine=other.worker_id, theirs=wid)
            except KVLayoutMismatch as exc:
                self.send(wid, m.RegisterAck(False, str(exc)))
                return
        old = self.workers.get(wid)
        if old is not None and old.alive:
            self._worker_lost(old, "it re-registered (restarted)")
        self.workers[wid] = info = WorkerInfo(
            wid, msg.role, msg.layout, msg.kv_endpoint, msg.total_blocks, msg.max_model_len, msg.pid
        )
        info.has_store = msg.has_store
        self.send(wid, m.RegisterAck(True))
        log.info("worker %s registered as %s", wid, msg.role)

    def _on_Heartbeat(self, wid: str, msg: m.Heartbeat) -> None:
        w = self.workers.get(msg.worker_id)  # sent from the worker's heartbeat socket "<id>#hb"
        if w is None or wid.partition("#")[0] != msg.worker_id:
            return
        if not w.alive:  # it was stalled, not dead: make it drop stale work and rejoin
            now = time.monotonic()
            if now - w.last_seen > 1.0:
                w.last_seen = now
                self.send(msg.worker_id, m.Reset())
            return
        w.last_seen = time.monotonic()
        if msg.load is not None:
            w.load = msg.load
        w.cached.difference_update(msg.removed)
        w.cached.update(msg.stored)
        self.store_index.update(msg.offloaded)
        self.store_index.difference_update(msg.store_removed)  # disjoint from offloaded

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for w in list(self.workers.values()):
                if w.alive and now - w.last_seen > self.config.heartbeat_timeout_s:
                    self._worker_lost(w, f"no heartbeat for {now - w.last_seen:.1f}s")

    def _worker_lost(self, w: WorkerInfo, why: str) -> None:
        """Stop routing to w; migrate or re-prefill every request it held."""
        log.warning("worker %s lost: %s", w.worker_id, why)
        w.alive = False
        metrics.WORKER_FAILURES.inc()
        for rid in list(w.inflight):
            state = self.requests.get(rid)
            if state is None or state.finished:
                continue
            if state.decode_id == w.worker_id:
                self._migrate(state)
            elif state.prefill_id == w.worker_id and state.decode_id:
                self.send(state.decode_id, m.KVReady(rid, None))  # D prefills locally
        w.inflight.clear()

    def _migrate(self, state: RequestState) -> None:
        """Replay prompt + tokens already streamed on another decode worker."""
        remaining = state.params.max_tokens - len(state.tokens)
        decode = self._pick_decode(state.prompt)
        if decode is None or remaining <= 0 or state.migrations >= 3:
            state.fail(503, "the worker serving this request failed and no other can take it")
            return
        state.migrations += 1
        metrics.MIGRATIONS.inc()
        state.decode_id, state.prefill_id, state.remote = decode.worker_id, None, False
        decode.inflight.add(state.request_id)
        params = m.Params(**{**_asdict(state.params), "max_tokens": remaining})
        self.send(
            decode.worker_id,
            m.Admit(
                state.request_id,
                state.prompt + state.tokens,
                params,
                remote_prefill=False,
                skip_tokens=len(state.tokens),
            ),
        )

    def alive(self, role: str | None = None) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.alive and (role is None or w.role == role)]

    async def wait_for_workers(self, prefill: int, decode: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (
                len(self.alive("prefill")) >= prefill
                and len([w for w in self.alive() if w.can_decode]) >= decode
            ):
                return True
            await asyncio.sleep(0.1)
        return False

    @property
    def max_model_len(self) -> int | None:
        lens = [w.max_model_len for w in self.alive()]
        return min(lens) if lens else None

    # -- placement -------------------------------------------------------------------------
    def _pick_decode(self, prompt: list[int]) -> WorkerInfo | None:
        """The worker where the prompt would compute the fewest prompt tokens before its first
        token: those queued there for local prefill plus its own uncached ones (a cached
        prefix saves its tokens); then the fewest requests in flight; then the most free
        blocks. A chat request thus does not wait behind another worker's 4k-token prefill to
        save one cached block, nor skip a cached prefix for a worker that is merely idle."""
        size = self.config.block_size
        hashes = block_hashes(prompt, size)
        candidates = [w for w in self.alive() if w.can_decode]
        if not candidates:
            return None
        queued = self._prefill_queues()

        def cost(w: WorkerInfo) -> tuple[int, int, int]:
            uncached = len(prompt) - min(w.overlap(hashes) * size, len(prompt))
            return queued[w.worker_id] + uncached, len(w.inflight), -w.free_blocks()

        return min(candidates, key=cost)

    def _pick_prefill(self, prompt: list[int]) -> WorkerInfo | None:
        hashes = block_hashes(prompt, self.config.block_size)
        candidates = self.alive("prefill")
        if not candidates:
            return None
        return min(
            candidates,
            key=lambda w: (-w.overlap(hashes), w.queued_prefill_tokens() + 1000 * len(w.inflight)),
        )

    def _cached_blocks(self, decode: WorkerInfo, hashes: list[int]) -> int:
        """Leading prompt blocks D can get without computing: its own prefix-cache hits, then
        (as D loads them) the blocks right after those that the KV store holds."""
        cached = decode.overlap(hashes)
        if decode.has_store:
            cached = next(
                (i for i in range(cached, len(hashes)) if hashes[i] not in self.store_index),
                len(hashes),
            )
        return cached

    def _prefill_remotely(self, decode: WorkerInfo, uncached: int, warm: bool) -> bool:
        """Conditional, cache-aware disaggregation. A long *uncached* part goes to the prefill
        pool. A short one is prefilled on D (no transfer, no extra hops) unless the pool is
        idle: then the pool takes it too, so that D's running streams are not paused by it
        (--keep-short-prefills-local turns that off). A warm prompt always loads its cached
        prefix (D's own cache or the KV store) on D and computes only the suffix there."""
        if self.config.mode != "disagg" or decode.role != "decode" or not self.alive("prefill"):
            return False
        if uncached >= self.config.local_prefill_threshold:
            return True
        return (
            self.config.short_prefills_to_idle_pool
            and not warm
            and uncached > 0
            and self.pending_prefill_tokens(remote=True, decode_id=decode.worker_id) == 0
        )

    def submit(self, prompt: list[int], params: m.Params) -> RequestState:
        """Place a validated request; its events arrive on the returned state's queue."""
        if len(self.requests) >= self.config.max_inflight:
            raise Overloaded(f"{len(self.requests)} requests are in flight (--max-inflight)")
        decode = self._pick_decode(prompt)
        if decode is None:
            raise LookupError("no decode worker is available")
        cached = self._cached_blocks(decode, block_hashes(prompt, self.config.block_size))
        overlap = min(cached * self.config.block_size, len(prompt))
        warm = overlap > 0 and overlap >= len(prompt) // 2
        remote = self._prefill_remotely(decode, len(prompt) - overlap, warm)
        self._admit_within_slo(decode, remote, len(prompt) - overlap)
        metrics.CACHE_TEMPERATURE.labels("warm" if warm else "cold").inc()
        metrics.PREFILL_DECISIONS.labels("remote" if remote else "local").inc()
        state = RequestState(
            f"r{next(self._ids)}",
            prompt,
            params,
            remote,
            decode_id=decode.worker_id,
            warm=warm,
            uncached_tokens=len(prompt) - overlap,
        )
        admit = m.Admit(state.request_id, prompt, params, remote, self.config.lease_s)
        if not self.send(decode.worker_id, admit):
            raise LookupError("the decode worker could not be reached")
        self.requests[state.request_id] = state
        decode.inflight.add(state.request_id)
        return state

    # -- admission control -----------------------------------------------------------------
    def _admit_within_slo(self, decode: WorkerInfo, remote: bool, uncached: int) -> None:
        """Raise Overloaded when admitting this request would miss the SLOs because of the
        work already admitted. A request is never refused for its own size alone (retrying
        would not help): with nothing queued ahead of it, it is admitted.

        TTFT estimate = (prompt tokens waiting for prefill where this one will be prefilled
        + this one's uncached tokens) / that pool's measured prefill tokens/s. TPOT = the
        decode worker's measured seconds per step while it decodes."""
        cfg = self.config
        if cfg.slo_ttft_s is not None:
            pool = self.alive("prefill") if remote else [decode]
            rate = sum(w.load.prefill_tok_s for w in pool if w.load is not None)
            ahead = self.pending_prefill_tokens(remote, decode.worker_id)
            if rate > 0 and ahead > 0:
                ttft = (ahead + uncached) / rate
                if ttft > cfg.slo_ttft_s * TTFT_HEADROOM:
                    raise Overloaded(
                        f"estimated time to first token {ttft:.2f} s is too close to the "
                        f"{cfg.slo_ttft_s:g} s SLO ({ahead} prompt tokens queued at "
                        f"{rate:.0f} tokens/s)",
                        reason="slo_ttft",
                        retry_after_s=_retry_after(ttft - cfg.slo_ttft_s * TTFT_HEADROOM),
                    )
        if cfg.slo_tpot_s is not None and decode.inflight and decode.load is not None:
            tpot = decode.load.decode_step_s
            if tpot > cfg.slo_tpot_s * TPOT_HEADROOM:
                raise Overloaded(
                    f"the decode worker's time per output token is {tpot * 1000:.0f} ms, too "
                    f"close to the {cfg.slo_tpot_s * 1000:g} ms SLO to take another stream",
                    reason="slo_tpot",
                    retry_after_s=2,
                )

    def pending_prefill_tokens(self, remote: bool, decode_id: str) -> int:
        """Prompt tokens admitted but not yet prefilled: in the prefill pool (remote) or on
        decode worker `decode_id` (local prefill)."""
        return self._prefill_queues()[None if remote else decode_id]

    def _prefill_queues(self) -> Counter[str | None]:
        """Prompt tokens admitted but not yet prefilled, by where they are prefilled: the id
        of the decode worker prefilling them itself, or None for the prefill pool."""
        queues: Counter[str | None] = Counter()
        for s in self.requests.values():
            if not s.tokens:
                queues[None if s.remote else s.decode_id] += s.uncached_tokens
        return queues

    def finish(self, state: RequestState, abort: bool) -> None:
        """Forget a request; with abort, tell every worker holding it to free its blocks."""
        self.requests.pop(state.request_id, None)
        for wid in (state.decode_id, state.prefill_id):
            w = self.workers.get(wid) if wid else None
            if w is None:
                continue
            w.inflight.discard(state.request_id)
            if abort and w.alive:
                self.send(wid, m.Abort(state.request_id))

    # -- messages about requests -----------------------------------------------------------
    def _on_Placement(self, wid: str, msg: m.Placement) -> None:
        state = self.requests.get(msg.request_id)
        if state is None:
            self.send(wid, m.Abort(msg.request_id))
            return
        prefill = self._pick_prefill(state.prompt)
        if prefill is None:
            self.send(wid, m.KVReady(msg.request_id, None))  # prefill locally on D
            return
        state.prefill_id = prefill.worker_id
        state.placed_at = time.monotonic()
        prefill.inflight.add(state.request_id)
        self.send(
            prefill.worker_id,
            m.Prefill(
                msg.request_id,
                state.prompt,
                state.params,
                msg.kv_endpoint,
                msg.block_ids,
                msg.num_cached_tokens,
            ),
        )

    def _on_PrefillDone(self, wid: str, msg: m.PrefillDone) -> None:
        state = self.requests.get(msg.request_id)
        w = self.workers.get(wid)
        if w is not None:
            w.inflight.discard(msg.request_id)
        if state is None:
            return
        metrics.KV_BYTES.inc(msg.transfer_bytes)
        metrics.KV_SECONDS.inc(msg.transfer_s)
        metrics.KV_EXPOSED.observe(msg.exposed_s)
        if state.placed_at is not None:  # D's blocks waited under lease this long
            metrics.DECODE_KV_WAIT.observe(time.monotonic() - state.placed_at)
        metrics.REMOTE_PREFILL.observe(msg.prefill_s)
        if msg.first_token is None:
            metrics.KV_FAILURES.inc()
            log.warning(
                "prefill of %s failed (%s): decode worker prefills locally",
                msg.request_id,
                msg.error,
            )
            self.send(state.decode_id, m.KVReady(msg.request_id, None))
            return
        state.deliver(0, msg.first_token, None)  # D reports whether it also ends the request
        self.send(state.decode_id, m.KVReady(msg.request_id, msg.first_token))

    def _on_Tokens(self, wid: str, msg: m.Tokens) -> None:
        for item in msg.items:
            state = self.requests.get(item.request_id)
            if state is not None and state.decode_id == wid:
                state.deliver(item.index, item.token, item.finish_reason)

    def _on_Failed(self, wid: str, msg: m.Failed) -> None:
        state = self.requests.get(msg.request_id)
        if state is not None:
            state.fail(msg.status, msg.error)

    def _on_RegisterAck(self, wid, msg) -> None:  # workers never send these
        pass


def _retry_after(seconds: float) -> int:
    """Whole seconds for a Retry-After header: at least 1, at most 30."""
    return max(1, min(30, math.ceil(seconds)))


def _asdict(p: m.Params) -> dict:
    import msgspec

    return msgspec.structs.asdict(p)


def _log_send_error(kind: str, worker_id: str, fut) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("could not send %s to %s: %s", kind, worker_id, fut.exception())
