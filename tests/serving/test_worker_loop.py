"""The worker loop against a stand-in router (a ZeroMQ ROUTER socket this test reads): a tiny
engine, the real `build_worker` wiring, the real loop on a thread."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import zmq
from factories import make_engine, make_model_files
from waiting import wait_until

from pdserve.protocol import messages as m
from pdserve.protocol.channel import Codec
from pdserve.serving.build import build_worker
from pdserve.serving.load_report import HEARTBEAT_S
from pdserve.serving.worker_config import WorkerConfig


class StandInRouter:
    """Accepts every registration and keeps what each worker sends on its control socket."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.codec = Codec(None)
        self.received: list = []
        self.identity: bytes | None = None

    def pump(self, timeout_ms: int = 50) -> None:
        """Read what came (answer registrations) for at most `timeout_ms`."""
        if not self.sock.poll(timeout_ms):
            return
        while self.sock.poll(0):
            ident, *frames = self.sock.recv_multipart()
            msg = self.codec.decode(frames)
            if isinstance(msg, m.Register):
                self.identity = ident
                self.sock.send_multipart([ident, *self.codec.encode(m.RegisterAck(ok=True))])
            elif msg is not None and not ident.endswith(b"#hb"):
                self.received.append(msg)

    def send(self, msg) -> None:
        self.sock.send_multipart([self.identity, *self.codec.encode(msg)])

    def close(self) -> None:
        self.sock.close()


class Counted:
    """A worker's publish and step calls, counted; `pause_after_step(n)` holds the loop after
    its n-th step until a message for it has arrived (so the test decides what comes between
    two steps)."""

    def __init__(self, worker) -> None:
        self.publish = self.step = 0
        self.pause_at: int | None = None
        self.paused = threading.Event()
        publish, step = worker.reporter.publish, worker.step

        def counted_publish():
            self.publish += 1
            publish()

        def counted_step():
            self.step += 1
            step()
            if self.step == self.pause_at:
                self.paused.set()
                worker.links[0].sock.poll(10_000)  # until the test's message is here

        worker.reporter.publish, worker.step = counted_publish, counted_step


@contextlib.contextmanager
def serving(monkeypatch, **engine_overrides):
    """(stand-in router, worker, its counts), the worker's loop running on a thread."""
    monkeypatch.delenv("PDSERVE_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_SECRET_FILE", raising=False)
    router = StandInRouter()
    engine = make_engine(make_model_files(seed=5), kv_cache_gb=0.002, **engine_overrides)
    config = WorkerConfig(engine=engine.config, routers=(router.endpoint,), worker_id="w0")
    worker = build_worker(config, engine)
    counts = Counted(worker)
    loop = threading.Thread(target=worker.run, daemon=True)
    loop.start()
    try:
        wait_until(lambda: (router.pump(), worker.registered)[1], 30, "the worker's registration")
        yield router, worker, counts
    finally:
        worker.running = False
        loop.join(timeout=10)
        router.close()


@pytest.fixture
def served(monkeypatch):
    with serving(monkeypatch, role="both") as parts:
        yield parts


def _rate_bound(seconds: float) -> float:
    """Publishes allowed in `seconds`: one per HEARTBEAT_S, plus one for the window's edges."""
    return seconds / HEARTBEAT_S + 2


def test_an_idle_worker_publishes_its_load_once_per_heartbeat(served):
    router, worker, counts = served
    before, t0 = counts.publish, time.monotonic()
    while time.monotonic() - t0 < 1.5:  # the loop polls every 20 ms: ~75 passes
        router.pump()
    elapsed = time.monotonic() - t0
    published = counts.publish - before
    assert 1 <= published <= _rate_bound(elapsed), (published, elapsed)


def test_a_decoding_worker_publishes_once_per_heartbeat_not_once_per_step(served):
    router, worker, counts = served
    before, steps0, t0 = counts.publish, counts.step, time.monotonic()
    router.send(
        m.Admit("r1", list(range(3, 20)), m.Params(max_tokens=150, ignore_eos=True), False, 30.0)
    )

    def finished():
        router.pump()
        items = [i for t in router.received if isinstance(t, m.Tokens) for i in t.items]
        return any(i.finish_reason is not None for i in items)

    wait_until(finished, 60, "the request to finish", interval_s=0)
    elapsed = time.monotonic() - t0
    steps, published = counts.step - steps0, counts.publish - before
    assert steps >= 150
    assert published <= _rate_bound(elapsed), (published, steps, elapsed)
    assert published < steps / 4


def test_a_prefill_worker_stops_a_prompt_between_chunks_when_it_is_aborted(monkeypatch):
    """A client that left before its first token: the router's Abort reaches the prefill
    worker while it computes the prompt, and the worker computes no further chunk of it,
    pushes nothing and frees every block."""
    with serving(monkeypatch, role="prefill", chunk_size=8) as (router, worker, counts):
        prompt = list(range(3, 203))  # 25 chunks of 8
        blocks = list(range(len(prompt) // 4 + 1))
        counts.pause_at = counts.step + 2
        router.send(m.Prefill("gone", prompt, m.Params(max_tokens=1), ["tcp://127.0.0.1:9"],
                              blocks, 0))  # fmt: skip
        assert counts.paused.wait(30), "the prompt's first chunks were not computed"
        router.send(m.Abort("gone"))
        engine = worker.engine
        wait_until(lambda: not engine.has_work(), 10, "the prompt to be dropped")
        assert counts.step == counts.pause_at  # not one chunk more
        assert not worker.prefill.request_ids
        router.pump()
        assert not [x for x in router.received if isinstance(x, m.PrefillDone)]
        wait_until(
            lambda: engine.block_manager.num_free_blocks == engine.block_manager.num_blocks,
            10, "every block free",
        )  # fmt: skip
