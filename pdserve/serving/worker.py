"""A worker process: one engine with a role, driven by the router over ZeroMQ.

`Worker` owns the loop, registration and the control messages, and hands each message to the
side that serves it: `DecodeSide` (roles decode and both: admitted requests, KV leases,
streamed tokens) or `PrefillSide` (role prefill: prompts whose KV it pushes into a decode
worker). It is assembled by `serving/build.py` `build_worker` (the engine's one KV connector,
the KV fabric, the store link); its heartbeats go out on a thread of their own
(`serving/load_report.py`).

A little over 300 lines: the loop and the control messages read the same requests and routers;
the wiring already lives in `serving/build.py` and the config checks in `worker_config.py`.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import zmq

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.pp.pipe import StageLost
from pdserve.kv_transfer import KVLayout
from pdserve.protocol import messages as m
from pdserve.serving.decode_side import DecodeSide
from pdserve.serving.load_report import HEARTBEAT_S, LoadReporter
from pdserve.serving.prefill_side import PrefillSide
from pdserve.serving.router_link import RouterLink, Routers
from pdserve.serving.store_link import StoreLink
from pdserve.serving.worker_config import WorkerConfig
from pdserve.subprocs import WorkerRefused, trim_heap

log = logging.getLogger("pdserve.worker")
PUSH_POLL_S = 0.002  # an idle prefill worker with pushes in flight reads the router this often
TRIM_INTERVAL_S = 5.0  # an idle worker gives freed heap back at most this often
IDLE_POLL_MS = 20  # an idle worker reads the routers this often
REGISTER_POLL_S = 0.2  # a worker waiting for a router to accept it sees a SIGTERM this often


class Worker:
    """The loop and control plane of one worker (see build_worker for its parts)."""

    def __init__(
        self, config: WorkerConfig, engine: LLMEngine, layout: KVLayout, routers: Routers,
        reporter: LoadReporter, *, decode: DecodeSide | None = None,
        prefill: PrefillSide | None = None, store: StoreLink | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.role = config.engine.role
        self.engine, self.layout, self.reporter = engine, layout, reporter
        self.routers = routers
        self.links = routers.links
        self.decode, self.prefill, self.store = decode, prefill, store
        self.sides = [side for side in (decode, prefill) if side is not None]
        self.running = True
        self.registered = False  # a router has accepted this worker once
        self.drain_requested = False  # set by SIGTERM (a signal handler: just a flag)
        self.draining_since: float | None = None
        self.refused: str | None = None  # why a router refused it while serving

    # -- control plane -------------------------------------------------------------------
    def send(self, msg) -> None:
        self.routers.send(msg)

    def registration(self) -> m.Register:
        receiver = self.decode.receiver if self.decode else None
        return m.Register(
            worker_id=self.config.worker_id,
            role=self.role,
            layout=self.layout,
            kv_endpoint=receiver.endpoint if receiver else None,
            total_blocks=self.engine.block_manager.num_blocks,
            has_store=self.store is not None,
            max_model_len=self.engine.max_model_len,
            pid=os.getpid(),
            cached=list(self.engine.block_manager.hash_to_block),
            placement={"host": socket.gethostname(), **dict(self.config.placement)},
            kv_compression=self.config.kv_compression,
            kv_transport=self.config.kv_transport,
        )

    def register(self, timeout_s: float = 60.0) -> None:
        """Register with every router; return once one has accepted (the others accept
        when they answer: a router that is down gets the registration when it comes up), or
        unregistered as soon as the worker is asked to leave (SIGTERM while it waits)."""
        for link in self.links:
            self.routers.send_to(link, self.registration())
        poller = zmq.Poller()
        for link in self.links:
            poller.register(link.sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.drain_requested:
                return
            for sock, _ in poller.poll(int(min(left, REGISTER_POLL_S) * 1000)):
                link = next(x for x in self.links if x.sock is sock)
                ack = self.routers.codec.decode(sock.recv_multipart())
                if not isinstance(ack, m.RegisterAck):
                    continue
                if not ack.ok:
                    raise WorkerRefused(f"the router at {link.endpoint} refused this worker: "
                                        f"{ack.error}")  # fmt: skip
                link.seen = time.monotonic()
                self.registered = True
                return
        routers = ", ".join(x.endpoint for x in self.links)
        raise RuntimeError(f"no router answered registration in {timeout_s:g} s ({routers})")

    def handle(self, msg: m.Message, link: RouterLink) -> None:
        """Act on one message from the router of `link`; a request that fails is reported,
        never the worker brought down."""
        link.seen = time.monotonic()
        if link.orphaned and not isinstance(msg, m.Reset | m.Shutdown):  # it is back: rejoin
            link.orphaned = link.shut_down = False  # (it declares our old self lost)
            self.routers.send_to(link, self.registration())
        rid = getattr(msg, "request_id", None)
        if isinstance(msg, (m.Admit, m.Prefill)):
            self.routers.owner[rid] = link
        elif rid is not None and self.routers.owner.get(rid, link) is not link:
            log.warning("ignored %s for %s from a router that did not place it",
                        type(msg).__name__, rid)  # fmt: skip
            return
        try:
            self.dispatch(msg, link)
        except ValueError as exc:  # a request the engine refuses: tell the client why
            self.send(m.Failed(rid or "?", str(exc), 400))
        except Exception as exc:  # a bug must fail one request, never the worker
            log.exception("failed to handle %s", type(msg).__name__)
            if rid is not None:
                self.abort(rid)
                self.send(m.Failed(rid, f"worker error: {type(exc).__name__}: {exc}", 500))

    def dispatch(self, msg: m.Message, link: RouterLink) -> None:
        match msg:
            case m.Admit() if self.decode is not None:
                self.decode.on_admit(msg)
            case m.KVReady() if self.decode is not None:
                self.decode.on_kv_ready(msg)
            case m.Prefill() if self.prefill is not None:
                self.prefill.on_prefill(msg)
            case m.Admit() | m.KVReady() | m.Prefill():
                raise ValueError(f"a {self.role} worker does not take {type(msg).__name__}")
            case m.Abort():
                self.abort(msg.request_id)
            case m.Reset():
                self.reset(link)
            case m.RegisterAck(ok=False):  # registering again: no restart fixes it either
                log.error("the router refused this worker: %s", msg.error)
                self.refused = f"the router at {link.endpoint} refused this worker: {msg.error}"
                self.running = False
            case m.Shutdown():  # the worker stops once every router it serves has
                link.shut_down = True
                if all(x.shut_down for x in self.links):
                    self.running = False
                else:  # serve the others; register again if this one comes back
                    self.drop(link)
                    link.orphaned = True
            case m.RegisterAck() | m.RouterBeat():
                pass
            case _:
                log.warning("ignored %s", type(msg).__name__)

    def abort(self, rid: str) -> None:
        for side in self.sides:
            side.abort(rid)
        self.engine.abort(rid)

    def drop_all(self) -> int:
        """Abort every request and free every block; how many requests there were."""
        rids = set(self.engine.requests).union(*(side.request_ids for side in self.sides))
        for rid in rids:
            self.abort(rid)
        for rid in list(self.engine.scheduler.held):
            self.engine.release(rid)
        self.routers.owner.clear()
        return len(rids)

    def drop(self, link: RouterLink) -> int:
        """Abort the requests `link`'s router placed here (all of them with one router)."""
        if len(self.links) == 1:
            return self.drop_all()
        rids = self.routers.requests_of(link)
        for rid in rids:
            self.abort(rid)
            del self.routers.owner[rid]
        return len(rids)

    def forget_finished(self) -> None:
        """Drop the owners of requests that left this worker."""
        live = set(self.engine.requests).union(
            self.engine.scheduler.held, *(side.request_ids for side in self.sides)
        )
        self.routers.forget(live)

    def orphan(self, link: RouterLink, now: float) -> None:
        """A router has been silent for --router-timeout-s (it died, or the network did):
        its clients are gone, so free what it had placed here, and register again when it
        speaks (a new one on its address answers our heartbeats with Reset)."""
        n = self.drop(link)
        link.orphaned = True
        log.warning(
            "no word from the router at %s for %.0f s: dropped %d requests and freed their "
            "blocks; waiting for a router", link.endpoint, now - link.seen, n,
        )  # fmt: skip

    def reset(self, link: RouterLink) -> None:
        """The router declared us dead (e.g. we stalled) and moved our requests elsewhere, or
        it does not know us (a new router on the old one's address; the old one's clients are
        gone): drop its requests, free their blocks, and register again (with our prefix
        cache's hashes, which a new router's index starts from)."""
        link.orphaned = False
        n = self.drop(link)
        log.warning("router reset this worker: dropped %d requests, registering again", n)
        self.routers.send_to(link, self.registration())

    def holds_work(self) -> bool:
        return self.engine.has_work() or any(side.request_ids for side in self.sides)

    def drain(self, now: float) -> None:
        """SIGTERM: tell the routers to place nothing new here, finish what this worker holds
        (streams, prefills, pushes), then leave; past --drain-timeout-s leave anyway, and the
        routers migrate what is left (no token lost or repeated)."""
        if self.draining_since is None:
            self.draining_since = now
            self.send(m.Draining(self.config.worker_id))
            log.warning("draining: finishing %d requests, then exiting (at most %g s)",
                        len(self.engine.requests), self.config.drain_timeout_s)  # fmt: skip
        late = now - self.draining_since > self.config.drain_timeout_s
        if self.holds_work() and not late:
            return
        left = len(self.engine.requests)
        self.send(m.Leaving(self.config.worker_id))
        self.running = False
        log.warning("drained in %.1f s; %d requests left to migrate", now - self.draining_since,
                    left)  # fmt: skip

    # -- engine ---------------------------------------------------------------------------
    def step(self) -> None:
        try:
            outs = self.engine.step()
        except StageLost:  # the engine cannot step again: exit, the launcher restarts it all
            raise
        except Exception as exc:  # never leave requests hanging: fail what was running
            log.exception("engine step failed")
            for seq in list(self.engine.scheduler.running):
                self.send(m.Failed(seq.request_id, f"engine error: {exc}", 500))
                self.engine.abort(seq.request_id)
            return
        if self.prefill is not None:
            self.prefill.finish(outs)
        else:
            self.decode.emit(outs)

    def run(self) -> None:
        self.register()
        if not self.registered:  # asked to leave before any router answered
            return
        self.reporter.publish()
        self.reporter.start()
        runner = self.engine.runner
        print(
            f"worker {self.config.worker_id} ({self.role}) ready: weights {runner.weights}, "
            f"decode {runner.decode_path}"
            + (f", activations {runner.activations}" if runner.activations != "dense" else "")
            + (
                f", KV cache {runner.config.kv_cache_dtype}"
                if runner.config.kv_cache_dtype != "auto"
                else ""
            ),
            flush=True,
        )
        next_beat = next_trim = 0.0
        stepped = False  # since the heap was last trimmed
        poller = zmq.Poller()
        for link in self.links:
            poller.register(link.sock, zmq.POLLIN)
        while self.running:
            busy = self.engine.has_work()
            pushing = self.prefill is not None and bool(self.prefill.pushing)
            if poller.poll(0 if busy or pushing else IDLE_POLL_MS):
                for link in self.links:
                    while link.sock.poll(0):
                        msg = self.routers.codec.decode(link.sock.recv_multipart())
                        if msg is not None:
                            self.handle(msg, link)
            now = time.monotonic()  # (silence is checked after reading what came)
            for link in self.links:
                if not link.orphaned and now - link.seen > self.config.router_timeout_s:
                    self.orphan(link, now)
            if self.decode is not None and self.decode.has_waiting():
                self.decode.try_place()
                self.decode.expire_leases(time.monotonic())
            if self.store is not None:
                for rid in self.store.poll():
                    self.engine.release(rid)
            if self.engine.has_work():
                self.step()
                stepped = True
            elif pushing:  # only acknowledgements to wait for: sleep until one comes
                self.prefill.wait_settle(PUSH_POLL_S)
            elif stepped and time.monotonic() >= next_trim:  # idle after work (a few ms)
                trim_heap()
                stepped, next_trim = False, time.monotonic() + TRIM_INTERVAL_S
            if time.monotonic() >= next_beat:  # a fresh snapshot for each beat, no more
                self.engine.check_stages()  # a dead pipeline stage: exit, to be restarted
                self.reporter.publish()
                self.forget_finished()
                next_beat = time.monotonic() + HEARTBEAT_S
            if self.drain_requested:
                self.drain(time.monotonic())
        self.close()

    def leave_now(self) -> None:
        """SIGINT (stop at once, `launch/local.py`): no more heartbeats, and the routers are
        told (`Leaving`), so they move what this worker held to others now rather than once
        its heartbeat lapses (`--heartbeat-timeout-s`) and without counting a failure. The
        rest goes with the process."""
        self.reporter.stop()
        if self.registered:
            self.send(m.Leaving(self.config.worker_id))
        # briefly: Ctrl-C on `pdserve serve` stops its router at the same moment, and a
        # router that is gone would hold each worker's exit for the whole linger
        self.routers.close(linger_ms=100)

    def close(self) -> None:
        receiver = self.decode.receiver if self.decode else None
        sender = self.prefill.sender if self.prefill else None
        self.reporter.stop()
        for c in (receiver, sender, self.store):
            if c is not None:
                c.close()
        self.routers.close()
        self.engine.close()
