"""A worker process: one engine with a role, driven by the router over ZeroMQ.

`Worker` owns the loop, the control socket, registration and the heartbeat thread, and hands
each message to the side that serves it: `DecodeSide` (roles decode and both: admitted
requests, KV leases, streamed tokens) or `PrefillSide` (role prefill: prompts whose KV it
pushes into a decode worker). The engine's KV moves through one connector: the prefill side's
push or the decode side's receive, and the KV store link.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import zmq

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.engine.kv_connector import combine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_store.client import StoreClient
from pdserve.kv_transfer import KVLayout, KVReceiver, make_receiver, make_sender
from pdserve.kv_transfer.group import ReceiverGroup
from pdserve.protocol import messages as m
from pdserve.protocol.channel import Codec, require_secret_for, resolve_secret
from pdserve.serving.decode_side import DecodeSide
from pdserve.serving.kv_staging import HostStaging
from pdserve.serving.load_report import HEARTBEAT_S, LoadReporter
from pdserve.serving.prefill_side import PrefillSide
from pdserve.serving.store_link import StoreLink
from pdserve.subprocs import trim_heap

log = logging.getLogger("pdserve.worker")
SEND_QUEUE = 100_000  # messages queued for a router before they are dropped (it is gone)
PUSH_POLL_S = 0.002  # an idle prefill worker with pushes in flight reads the router this often
TRIM_INTERVAL_S = 5.0  # an idle worker gives freed heap back at most this often


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig
    routers: tuple[str, ...]  # tcp://host:port of each router's control socket (one or more)
    worker_id: str
    kv_transport: str = "tcp"
    kv_host: str = "127.0.0.1"
    transfer_timeout_s: float = m.TRANSFER_TIMEOUT_S  # --transfer-timeout-s
    router_timeout_s: float = m.ROUTER_TIMEOUT_S  # router silence before its requests drop
    kv_store: str | None = None  # endpoint of a `pdserve store` (tcp://host:port)
    placement: tuple[tuple[str, str], ...] = ()  # reported in /health (e.g. Ray node, actor)
    kv_compression: str = "none"  # --kv-compression: fp8 on the wire (tcp only)
    drain_timeout_s: float = m.DRAIN_TIMEOUT_S  # --drain-timeout-s: SIGTERM -> finish, exit


class RouterLink:
    """This worker's control connection to one router: when it last spoke, and whether the
    worker dropped its requests after a silence (it registers again when the router speaks)."""

    def __init__(self, endpoint: str, worker_id: str) -> None:
        self.endpoint = endpoint
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        self.sock.connect(endpoint)
        self.seen = time.monotonic()
        self.orphaned = False
        self.shut_down = False  # the router told this worker to stop (it is shutting down)

    def send(self, frames: list[bytes]) -> None:
        """Queue a message; never blocks the engine loop on a router that is gone (one that
        has SEND_QUEUE messages unread is: its requests are dropped when its silence times
        out)."""
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("the router at %s reads nothing: message dropped", self.endpoint)


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.role = config.engine.role
        self.engine = LLMEngine(config.engine)
        self.engine.warm_up()
        runner, mc = self.engine.runner, self.engine.model_config
        self.layout = KVLayout(  # rank 0's: a tensor-parallel group's ranks hold their heads
            model_fingerprint=self.engine.fingerprint,
            dtype=str(runner.dtype).removeprefix("torch."),
            num_layers=mc.num_layers,
            block_size=config.engine.block_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
        ).split(config.engine.tensor_parallel_size)
        if config.kv_store and runner.device.type != "cpu":
            raise ValueError(
                f"the KV store (--kv-store) moves blocks of a host-memory KV cache; this worker's "
                f"cache is on {runner.device}: run it without --kv-store, or with --device cpu"
            )
        secret = resolve_secret()
        self.codec = Codec(secret)
        self.staging = None
        ranks = runner.rank_caches  # every rank's (K, V) caches: the connectors move them all
        if self.role != "both" and (runner.device.type != "cpu" or envs.kv_staging()):
            if len(ranks) > 1:
                raise ValueError(
                    "host staging of KV transfers (a GPU cache, or PDSERVE_KV_STAGING) moves "
                    "one rank's cache: run tensor-parallel workers on CPU without it"
                )
            # the connectors move host memory: stage the GPU cache's transfers through it
            self.staging = HostStaging.sized(*ranks[0], self.engine.max_model_len)
            ranks = [(self.staging.k_caches, self.staging.v_caches)]
        self.decode = self.prefill = self.store = None
        connectors = []
        if self.role == "prefill":
            compression = {"none": None}.get(config.kv_compression, config.kv_compression)
            group = {"ranks": ranks} if len(ranks) > 1 else {}
            sender = make_sender(config.kv_transport, self.layout, *ranks[0],
                                 compression=compression, **group)  # fmt: skip
            self.prefill = PrefillSide(
                self.engine, sender, self.send, config.transfer_timeout_s, self.staging
            )
            connectors.append(self.prefill)
        else:
            receiver = None
            if self.role == "decode":
                require_secret_for(config.kv_host, secret)
                receiver = self._receiver(ranks)
                receiver.start()
            self.decode = DecodeSide(
                self.engine, self.layout, self.send, config.worker_id, receiver, self.staging
            )
        if config.kv_store:  # first: a prefix it loads is not pushed (DecodeSide.on_allocate)
            client = StoreClient(config.kv_store, self.layout, runner.k_caches, runner.v_caches)
            self.store = StoreLink.for_role(client, self.engine.block_manager, self.role)
            connectors.insert(0, self.store)
        if self.decode is not None and self.decode.receiver is not None:
            connectors.append(self.decode)
        self.engine.connect(combine(connectors))
        self.sides = [side for side in (self.decode, self.prefill) if side is not None]
        self.links = [RouterLink(r, config.worker_id) for r in config.routers]
        self.owner: dict[str, RouterLink] = {}  # request -> the router that placed it here
        self.running = True
        self.registered = False  # a router has accepted this worker once
        self.drain_requested = False  # set by SIGTERM (a signal handler: just a flag)
        self.draining_since: float | None = None
        self.reporter = LoadReporter(self)

    def _receiver(self, ranks) -> KVReceiver:
        """One receiver per rank (its own endpoint; it writes that rank's cache, its heads)."""
        cfg = self.config
        receivers = [
            make_receiver(cfg.kv_transport, self.layout.shard(r), k, v, cfg.kv_host)
            for r, (k, v) in enumerate(ranks)
        ]
        return receivers[0] if len(receivers) == 1 else ReceiverGroup(receivers)

    # -- control plane -------------------------------------------------------------------
    def send(self, msg) -> None:
        """To the router that placed the message's request (to every router if none did); a
        batch of tokens is split between the routers whose requests it carries."""
        if isinstance(msg, m.Tokens) and len(self.links) > 1:
            parts: dict[RouterLink | None, list[m.TokenOut]] = {}
            for item in msg.items:
                parts.setdefault(self.owner.get(item.request_id), []).append(item)
            for link, items in parts.items():
                for target in [link] if link is not None else self.links:
                    target.send(self.codec.encode(m.Tokens(msg.worker_id, items)))
            return
        link = self.owner.get(getattr(msg, "request_id", None))
        for target in [link] if link is not None else self.links:
            target.send(self.codec.encode(msg))

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
        )

    def register(self, timeout_s: float = 60.0) -> None:
        """Register with every router; return once one has accepted (the others accept
        when they answer: a router that is down gets the registration when it comes up)."""
        for link in self.links:
            link.send(self.codec.encode(self.registration()))
        poller = zmq.Poller()
        for link in self.links:
            poller.register(link.sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(int(left * 1000)):
                link = next(x for x in self.links if x.sock is sock)
                ack = self.codec.decode(sock.recv_multipart())
                if not isinstance(ack, m.RegisterAck):
                    continue
                if not ack.ok:
                    raise RuntimeError(f"the router at {link.endpoint} refused this worker: "
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
            link.send(self.codec.encode(self.registration()))
        rid = getattr(msg, "request_id", None)
        if isinstance(msg, (m.Admit, m.Prefill)):
            self.owner[rid] = link
        elif rid is not None and self.owner.get(rid, link) is not link:
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
            case m.RegisterAck(ok=False):
                log.error("the router refused this worker: %s", msg.error)
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
        self.owner.clear()
        return len(rids)

    def drop(self, link: RouterLink) -> int:
        """Abort the requests `link`'s router placed here (all of them with one router)."""
        if len(self.links) == 1:
            return self.drop_all()
        rids = [rid for rid, owner in self.owner.items() if owner is link]
        for rid in rids:
            self.abort(rid)
            del self.owner[rid]
        return len(rids)

    def forget_finished(self) -> None:
        """Drop the owners of requests that left this worker."""
        live = set(self.engine.requests).union(
            self.engine.scheduler.held, *(side.request_ids for side in self.sides)
        )
        for rid in [rid for rid in self.owner if rid not in live]:
            del self.owner[rid]

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
        link.send(self.codec.encode(self.registration()))

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
        self.reporter.publish()
        threading.Thread(target=self.reporter.loop, daemon=True).start()
        runner = self.engine.runner
        print(
            f"worker {self.config.worker_id} ({self.role}) ready: weights {runner.weights}, "
            f"decode {runner.decode_path}",
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
            if poller.poll(0 if busy or pushing else 20):
                for link in self.links:
                    while link.sock.poll(0):
                        msg = self.codec.decode(link.sock.recv_multipart())
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
            if time.monotonic() >= next_beat:
                self.reporter.publish()
                self.forget_finished()
            if self.drain_requested:
                self.drain(time.monotonic())
                next_beat = time.monotonic() + HEARTBEAT_S / 2
        self.close()

    def close(self) -> None:
        receiver = self.decode.receiver if self.decode else None
        sender = self.prefill.sender if self.prefill else None
        for c in (receiver, sender, self.store):
            if c is not None:
                c.close()
        for link in self.links:
            link.sock.setsockopt(zmq.LINGER, 1000)  # the last messages (Leaving) go out
            link.sock.close()
        self.engine.close()
