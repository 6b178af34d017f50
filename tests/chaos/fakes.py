"""A fake prefill worker that speaks the real control protocol, for faults a real worker does
not make on demand: it takes `Prefill` messages and then never answers (a stalled KV transfer,
so the decode worker's lease expires) or answers that the transfer failed.

It registers with the same KV layout as the real workers (computed from the model file, no
weights loaded) and heartbeats, so the router treats it as a healthy prefill worker.
"""

from __future__ import annotations

import threading
import time

import zmq

from pdserve.kv_transfer.layout import KVLayout
from pdserve.protocol import messages as m
from pdserve.protocol.channel import Codec


def real_layout(dtype: str = "float32", block_size: int = 16) -> KVLayout:
    """The KVLayout that `pdserve worker` registers for the bundled model."""
    from pdserve.model.loader import fingerprint, load_model_config

    path, config = load_model_config(None)
    return KVLayout(
        model_fingerprint=fingerprint(path, config),
        dtype=dtype,
        num_layers=config.num_layers,
        block_size=block_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
    )


class FakePrefill:
    """mode "stall": swallow Prefill; mode "fail": answer PrefillDone(first_token=None).
    `claim`: block hashes it reports as cached, so the router prefers it for those prompts."""

    def __init__(
        self,
        endpoint: str,
        worker_id: str,
        mode: str,
        layout: KVLayout,
        claim: list[int] = (),
        **codec,
    ):
        assert mode in ("stall", "fail")
        self.worker_id, self.mode, self.layout, self.claim = worker_id, mode, layout, list(claim)
        self.codec = Codec(**codec)
        self.prefills: list[m.Prefill] = []
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.running = True
        self.ack: m.RegisterAck | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def register(self, timeout_s: float = 5.0) -> m.RegisterAck | None:
        """Send Register; the RegisterAck, or None when the router did not answer."""
        self.sock.send_multipart(
            self.codec.encode(
                m.Register(self.worker_id, "prefill", self.layout, None, 1024, 8192, pid=0)
            )
        )
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        self.ack = self.codec.decode(self.sock.recv_multipart())
        if self.ack is not None and self.ack.ok:
            self.thread.start()
        return self.ack

    def _beat(self) -> None:
        load = m.Load(0, 0, 0, 0, 1024, 1024, 0, 0, 0)
        self.sock.send_multipart(
            self.codec.encode(m.Heartbeat(self.worker_id, load, stored=self.claim))
        )

    def _loop(self) -> None:
        next_beat = 0.0
        while self.running:
            if time.monotonic() >= next_beat:
                self._beat()
                next_beat = time.monotonic() + 0.3
            if not self.sock.poll(50):
                continue
            msg = self.codec.decode(self.sock.recv_multipart())
            if isinstance(msg, m.Prefill):
                self.prefills.append(msg)
                if self.mode == "fail":
                    done = m.PrefillDone(msg.request_id, None, error="injected: transfer dropped")
                    self.sock.send_multipart(self.codec.encode(done))

    def close(self) -> None:
        """Stop heartbeating: the router declares this worker dead after its timeout."""
        self.running = False
        if self.thread.is_alive():
            self.thread.join(2)
        self.sock.close()
