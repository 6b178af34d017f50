"""A worker's load reports: the engine thread snapshots its load, KV events and integrity
(`publish`); a thread of its own sends them to each router every HEARTBEAT_S on sockets of its
own (`loop`), so that a long prefill step never looks like a dead worker."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import zmq

from pdserve.protocol import messages as m
from pdserve.serving.store_link import split_index_events

if TYPE_CHECKING:
    from pdserve.serving.worker import Worker

HEARTBEAT_S = 0.5


class LoadReporter:
    def __init__(self, worker: Worker):
        self.worker = worker
        self.load: m.Load | None = None
        self.integrity_error: str | None = None  # last check_integrity() verdict while idle
        self.events: deque[tuple[str, int]] = deque()
        self.store_events: deque[tuple[int, bool]] = deque()  # (hash, in the KV store now)

    def publish(self) -> None:
        """Engine thread: snapshot load and KV events for the heartbeat thread to send."""
        w = self.worker
        st = w.engine.stats()
        if w.store is not None:
            st["store_hit_tokens"] = w.store.hit_tokens
            st["store_query_tokens"] = w.store.query_tokens
            self.store_events.extend(w.store.take_index_events())
        # The check walks every block: run it only while idle, not between engine steps.
        if not w.engine.has_work():
            try:
                w.engine.check_integrity()
                if w.staging is not None:
                    w.staging.check()
                self.integrity_error = None
            except AssertionError as exc:
                self.integrity_error = str(exc) or "integrity check failed"
        st["integrity_error"] = self.integrity_error
        self.load = m.Load(**{k: st[k] for k in m.Load.__struct_fields__ if k in st})
        self.events.extend(w.engine.block_manager.drain_events())

    def loop(self) -> None:
        """Own thread and socket, until the worker stops."""
        w = self.worker
        socks = []
        for endpoint in w.config.routers:  # each router gets every beat (and every KV event)
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"{w.config.worker_id}#hb".encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            socks.append(sock)
        while w.running:
            events = [self.events.popleft() for _ in range(len(self.events))]
            held, gone = split_index_events(
                [self.store_events.popleft() for _ in range(len(self.store_events))]
            )
            beat = m.Heartbeat(
                w.config.worker_id,
                self.load,
                stored=[h for kind, h in events if kind == "stored"],
                removed=[h for kind, h in events if kind == "removed"],
                offloaded=held,
                store_removed=gone,
            )
            frames = w.codec.encode(beat)
            for sock in socks:
                sock.send_multipart(frames)
            time.sleep(HEARTBEAT_S)
        for sock in socks:
            sock.close()
