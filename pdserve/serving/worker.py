"""A worker process: one engine with a role, driven by the router over ZeroMQ.

Queues inside a decode worker:  pending (no blocks yet) -> transferring (lease, KV arriving)
                                -> running -> finished
A prefill worker computes prompts and pushes each layer's KV into the decode worker's blocks as
soon as that layer's forward pass ends; its blocks are held until the push is acknowledged.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import zmq

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, StepOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.kv_store.client import StoreClient
from pdserve.kv_transfer import KVLayout, make_receiver, make_sender
from pdserve.protocol import messages as m
from pdserve.protocol.channel import Codec, require_secret_for, resolve_secret
from pdserve.serving.kv_staging import HostStaging
from pdserve.serving.store_link import StoreLink, split_index_events

log = logging.getLogger("pdserve.worker")
HEARTBEAT_S = 0.5


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig
    router: str  # tcp://host:port of the router's control socket
    worker_id: str
    kv_transport: str = "tcp"
    kv_host: str = "127.0.0.1"
    transfer_timeout_s: float = 30.0
    kv_store: str | None = None  # endpoint of a `pdserve store` (tcp://host:port)


@dataclass
class Outgoing:
    request_id: str
    endpoint: str
    dst_block_ids: list[int]
    first_block: int
    started: float = field(default_factory=time.monotonic)


def to_sampling(p: m.Params, **overrides) -> SamplingParams:
    return SamplingParams(**{**msgspec.structs.asdict(p), **overrides})


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.role = config.engine.role
        self.engine = LLMEngine(config.engine)
        self.engine.warm_up()
        runner, mc = self.engine.runner, self.engine.model_config
        self.layout = KVLayout(
            model_fingerprint=self.engine.fingerprint,
            dtype=str(runner.dtype).removeprefix("torch."),
            num_layers=mc.num_layers,
            block_size=config.engine.block_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
        )
        secret = resolve_secret()
        self.receiver = self.sender = self.staging = None
        caches = runner.k_caches, runner.v_caches
        if self.role != "both" and (runner.device.type != "cpu" or envs.kv_staging()):
            # the connectors move host memory: stage the GPU cache's transfers through it
            self.staging = HostStaging.sized(*caches, self.engine.max_model_len)
            caches = self.staging.k_caches, self.staging.v_caches
        if self.role == "decode":
            require_secret_for(config.kv_host, secret)
            self.receiver = make_receiver(config.kv_transport, self.layout, *caches, config.kv_host)
            self.receiver.start()
        if self.role == "prefill":
            self.sender = make_sender(config.kv_transport, self.layout, *caches)
        self.store = None
        if config.kv_store and runner.device.type != "cpu":
            raise ValueError(
                f"the KV store (--kv-store) moves blocks of a host-memory KV cache; this worker's "
                f"cache is on {runner.device}: run it without --kv-store, or with --device cpu"
            )
        if config.kv_store:
            client = StoreClient(config.kv_store, self.layout, runner.k_caches, runner.v_caches)
            self.store = StoreLink(client)
            self.store.attach(self.engine)
            self.engine.hold_finished = self.role != "prefill"
        self.codec = Codec(secret)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, config.worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(config.router)
        self.pending: list[tuple[m.Admit, float]] = []  # decode: waiting for free blocks
        self.leases: dict[str, float] = {}  # decode: request -> deadline
        self.outgoing: dict[str, Outgoing] = {}  # prefill: request -> push destination
        self.index_offset: dict[str, int] = {}  # tokens streamed before this worker took over
        self.running = True
        self.load: m.Load | None = None
        self.integrity_error: str | None = None  # last check_integrity() verdict while idle
        self.events: deque[tuple[str, int]] = deque()
        self.store_events: deque[tuple[int, bool]] = deque()  # (hash, in the KV store now)

    # -- control plane -------------------------------------------------------------------
    def send(self, msg) -> None:
        self.sock.send_multipart(self.codec.encode(msg))

    def registration(self) -> m.Register:
        return m.Register(
            worker_id=self.config.worker_id,
            role=self.role,
            layout=self.layout,
            kv_endpoint=self.receiver.endpoint if self.receiver else None,
            total_blocks=self.engine.block_manager.num_blocks,
            has_store=self.store is not None,
            max_model_len=self.engine.max_model_len,
            pid=os.getpid(),
        )

    def register(self, timeout_s: float = 60.0) -> None:
        self.send(self.registration())
        if not self.sock.poll(int(timeout_s * 1000)):
            raise RuntimeError(f"the router at {self.config.router} did not answer registration")
        ack = self.codec.decode(self.sock.recv_multipart())
        if not isinstance(ack, m.RegisterAck) or not ack.ok:
            raise RuntimeError(f"the router refused this worker: {getattr(ack, 'error', ack)}")

    def publish_load(self) -> None:
        """Engine thread: snapshot load and KV events for the heartbeat thread to send."""
        st = self.engine.stats()
        if self.store is not None:
            st["store_hit_tokens"] = self.store.hit_tokens
            st["store_query_tokens"] = self.store.query_tokens
            self.store_events.extend(self.store.take_index_events())
        # The check walks every block: run it only while idle, not between engine steps.
        if not self.engine.has_work():
            try:
                self.engine.check_integrity()
                if self.staging is not None:
                    self.staging.check()
                self.integrity_error = None
            except AssertionError as exc:
                self.integrity_error = str(exc) or "integrity check failed"
        st["integrity_error"] = self.integrity_error
        self.load = m.Load(**{k: st[k] for k in m.Load.__struct_fields__ if k in st})
        self.events.extend(self.engine.block_manager.drain_events())

    def heartbeat_loop(self) -> None:
        """Own thread and socket, so that a long prefill step never looks like a dead worker."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.config.worker_id}#hb".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.config.router)
        while self.running:
            events = [self.events.popleft() for _ in range(len(self.events))]
            held, gone = split_index_events(
                [self.store_events.popleft() for _ in range(len(self.store_events))]
            )
            beat = m.Heartbeat(
                self.config.worker_id,
                self.load,
                stored=[h for kind, h in events if kind == "stored"],
                removed=[h for kind, h in events if kind == "removed"],
                offloaded=held,
                store_removed=gone,
            )
            sock.send_multipart(self.codec.encode(beat))
            time.sleep(HEARTBEAT_S)
        sock.close()

    def handle(self, msg) -> None:
        handler = getattr(self, f"on_{type(msg).__name__}", None)
        if handler is None:
            log.warning("ignored %s", type(msg).__name__)
            return
        try:
            handler(msg)
        except ValueError as exc:  # a request the engine refuses: tell the client why
            self.send(m.Failed(getattr(msg, "request_id", "?"), str(exc), 400))
        except Exception as exc:  # a bug must fail one request, never the worker
            log.exception("failed to handle %s", type(msg).__name__)
            if hasattr(msg, "request_id"):
                self.on_Abort(m.Abort(msg.request_id))
                self.send(
                    m.Failed(msg.request_id, f"worker error: {type(exc).__name__}: {exc}", 500)
                )

    def on_Reset(self, msg: m.Reset) -> None:
        """The router declared us dead (e.g. we stalled) and moved our requests elsewhere:
        drop them all, free every block, and register again."""
        rids = {
            *self.engine.requests,
            *self.leases,
            *self.outgoing,
            *(a.request_id for a, _ in self.pending),
        }
        for rid in rids:
            self.on_Abort(m.Abort(rid))
        for rid in list(self.engine.scheduler.held):
            self.engine.release(rid)
        log.warning("router reset this worker: dropped %d requests, registering again", len(rids))
        self.send(self.registration())

    def on_RegisterAck(self, msg: m.RegisterAck) -> None:
        if not msg.ok:
            log.error("the router refused this worker: %s", msg.error)
            self.running = False

    def on_Shutdown(self, msg: m.Shutdown) -> None:
        self.running = False

    def on_Abort(self, msg: m.Abort) -> None:
        rid = msg.request_id
        self.pending = [(a, t) for a, t in self.pending if a.request_id != rid]
        self.leases.pop(rid, None)
        self.outgoing.pop(rid, None)
        if self.receiver is not None:
            self.receiver.release(rid)  # no byte lands in these blocks after this
        if self.staging is not None:
            self.staging.release(rid)
        self.engine.abort(rid)
        self.index_offset.pop(rid, None)

    def on_Admit(self, msg: m.Admit) -> None:
        self.index_offset[msg.request_id] = msg.skip_tokens
        if msg.remote_prefill and self.receiver is not None:
            self.pending.append((msg, time.monotonic()))
            self.try_place()
        else:
            self.engine.add_request(msg.prompt, to_sampling(msg.params), msg.request_id)

    def try_place(self) -> None:
        """Give pending remote-prefill requests blocks, oldest first, and answer Placement."""
        bs = self.layout.block_size
        while self.pending:
            admit, _ = self.pending[0]
            # the most host blocks it can need (its cached prefix is known once it has blocks)
            if self.staging is not None and self.staging.num_free < -(-len(admit.prompt) // bs):
                return
            seq = self.engine.make_sequence(
                admit.prompt, to_sampling(admit.params), admit.request_id
            )
            if not self.engine.add_transferring(seq):
                return
            self.pending.pop(0)
            first = seq.num_cached_tokens // bs
            dst = seq.block_table[first:]
            if self.staging is not None:  # the KV lands in host blocks (checked free above)
                dst = self.staging.take(seq.request_id, len(dst))
            self.receiver.expect(seq.request_id, dst)
            self.leases[seq.request_id] = time.monotonic() + admit.lease_s
            self.send(
                m.Placement(
                    seq.request_id,
                    seq.block_table[:first] + dst,
                    seq.num_cached_tokens,
                    self.receiver.endpoint,
                )
            )

    def on_KVReady(self, msg: m.KVReady) -> None:
        rid = msg.request_id
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
        if not complete:
            log.warning(
                "KV of %s incomplete (%s, %d layers): prefilling locally", rid, error, landed
            )
            self.engine.resume_local(rid)
            return
        out = self.engine.start_decoding(rid, msg.first_token)
        if out is not None:
            self.emit([out])

    def on_Prefill(self, msg: m.Prefill) -> None:
        first = msg.num_cached_tokens // self.layout.block_size
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

    # -- engine ---------------------------------------------------------------------------
    def push_layer(self, batch: ScheduledBatch, layer: int) -> None:
        """After layer `layer`: queue its KV of every prompt that completes in this step."""
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

    def finish_prefills(self, outs: list[StepOutput]) -> None:
        for o in outs:
            out = self.outgoing.pop(o.seq.request_id, None)
            if out is None:
                continue
            t = time.monotonic()
            res = self.sender.wait(o.seq.request_id, self.config.transfer_timeout_s)
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
                )
            )

    def emit(self, outs: list[StepOutput]) -> None:
        items = []
        for o in outs:
            rid = o.seq.request_id
            index = self.index_offset.get(rid, 0) + o.seq.num_output_tokens - 1
            items.append(
                m.TokenOut(rid, index, o.new_token, o.seq.finish_reason if o.finished else None)
            )
            if o.finished:
                self.index_offset.pop(rid, None)
                if self.store is not None and not self.store.offload(o.seq):
                    self.engine.release(rid)
        if items:
            self.send(m.Tokens(self.config.worker_id, items))

    def expire_leases(self) -> None:
        now = time.monotonic()
        for rid, deadline in list(self.leases.items()):
            if now > deadline:
                log.warning("lease of %s expired before its KV arrived: prefilling locally", rid)
                del self.leases[rid]
                self.receiver.release(rid)
                if self.staging is not None:
                    self.staging.release(rid)
                self.engine.resume_local(rid)

    def step(self) -> None:
        hook = self.push_layer if self.role == "prefill" and self.outgoing else None
        try:
            outs = self.engine.step(hook)
        except Exception as exc:  # never leave requests hanging: fail what was running
            log.exception("engine step failed")
            for seq in list(self.engine.scheduler.running):
                self.send(m.Failed(seq.request_id, f"engine error: {exc}", 500))
                self.engine.abort(seq.request_id)
            return
        if self.role == "prefill":
            self.finish_prefills(outs)
        else:
            self.emit(outs)

    def run(self) -> None:
        self.register()
        self.publish_load()
        threading.Thread(target=self.heartbeat_loop, daemon=True).start()
        runner = self.engine.runner
        print(
            f"worker {self.config.worker_id} ({self.role}) ready: weights {runner.weights}, "
            f"decode {runner.decode_path}",
            flush=True,
        )
        next_beat = 0.0
        while self.running:
            busy = self.engine.has_work()
            if self.sock.poll(0 if busy else 20):
                while self.sock.poll(0):
                    msg = self.codec.decode(self.sock.recv_multipart())
                    if msg is not None:
                        self.handle(msg)
            if self.pending:
                self.try_place()
            if self.leases:
                self.expire_leases()
            if self.store is not None:
                for rid in self.store.poll():
                    self.engine.release(rid)
            if self.engine.has_work():
                self.step()
            if time.monotonic() >= next_beat:
                self.publish_load()
                next_beat = time.monotonic() + HEARTBEAT_S / 2
        self.close()

    def close(self) -> None:
        for c in (self.receiver, self.sender, self.store):
            if c is not None:
                c.close()
        self.sock.close()
