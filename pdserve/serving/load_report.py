"""A worker's load reports: the engine thread takes a snapshot of its load, KV events and
integrity (`LoadReporter.publish`, about once per HEARTBEAT_S); a thread of its own sends the
latest to each router every HEARTBEAT_S on sockets of its own (`loop`), so that a long prefill
step never looks like a dead worker."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import zmq

from pdserve.protocol import messages as m
from pdserve.protocol.channel import Codec
from pdserve.serving.store_link import split_index_events

HEARTBEAT_S = 0.5


class LoadSnapshot(NamedTuple):
    load: m.Load
    kv_events: list[tuple[str, int]]  # ("stored" | "removed", block hash) since the last one
    store_events: list[tuple[int, bool]]  # (hash, in the KV store now) since the last one


class LoadProbe:
    """The snapshot function of one worker's engine (and its KV store link and host staging):
    called on the engine thread, between steps."""

    def __init__(self, engine, store=None, staging=None, decode=None) -> None:
        self.engine, self.store, self.staging, self.decode = engine, store, staging, decode
        self.integrity_error: str | None = None  # the last check_integrity() verdict

    def __call__(self) -> LoadSnapshot:
        engine, store = self.engine, self.store
        st = engine.stats()
        store_events = []
        if store is not None:
            st["store_hit_tokens"] = store.hit_tokens
            st["store_query_tokens"] = store.query_tokens
            store_events = store.take_index_events()
        # The check walks every block: run it only while idle, not between engine steps.
        if not engine.has_work():
            try:
                engine.check_integrity()
                if self.staging is not None:
                    self.staging.check()
                self.integrity_error = None
            except AssertionError as exc:
                self.integrity_error = str(exc) or "integrity check failed"
        st["integrity_error"] = self.integrity_error
        if self.decode is not None:
            st["leases_expired"] = self.decode.leases_expired
        load = m.Load(**{k: st[k] for k in m.Load.__struct_fields__ if k in st})
        return LoadSnapshot(load, engine.block_manager.drain_events(), store_events)


class LoadReporter:
    """Sends a worker's heartbeats: the latest snapshot, and every KV event since the last."""

    def __init__(
        self, worker_id: str, routers: tuple[str, ...], codec: Codec,
        snapshot: Callable[[], LoadSnapshot],
    ) -> None:  # fmt: skip
        self.worker_id, self.routers, self.codec = worker_id, routers, codec
        self.snapshot = snapshot
        self.load: m.Load | None = None
        self.events: deque[tuple[str, int]] = deque()
        self.store_events: deque[tuple[int, bool]] = deque()  # (hash, in the KV store now)
        self._stop = threading.Event()

    def publish(self) -> None:
        """Engine thread: snapshot load and KV events for the heartbeat thread to send."""
        snap = self.snapshot()
        self.load = snap.load
        self.events.extend(snap.kv_events)
        self.store_events.extend(snap.store_events)

    def start(self) -> None:
        threading.Thread(target=self.loop, name="heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def loop(self) -> None:
        """Own thread and sockets, until `stop`."""
        socks = []
        for endpoint in self.routers:  # each router gets every beat (and every KV event)
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"{self.worker_id}#hb".encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            socks.append(sock)
        while True:
            frames = self.codec.encode(self.beat())
            for sock in socks:
                sock.send_multipart(frames)
            if self._stop.wait(HEARTBEAT_S):
                break
        for sock in socks:
            sock.close()

    def beat(self) -> m.Heartbeat:
        """The next heartbeat: takes the KV events queued since the last."""
        events = [self.events.popleft() for _ in range(len(self.events))]
        held, gone = split_index_events(
            [self.store_events.popleft() for _ in range(len(self.store_events))]
        )
        return m.Heartbeat(
            self.worker_id,
            self.load,
            stored=[h for kind, h in events if kind == "stored"],
            removed=[h for kind, h in events if kind == "removed"],
            offloaded=held,
            store_removed=gone,
        )
