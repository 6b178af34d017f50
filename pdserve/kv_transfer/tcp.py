"""The built-in TCP connector, sender side: header frame + raw block bytes straight from cache
memory, one acknowledgement per layer (receiver side: tcp_receiver.py; protocol: wire.py).

Each sender keeps one persistent connection per receiver endpoint, written by that endpoint's
channel thread (send_queue.py) while a second thread reads acknowledgements.
"""

from __future__ import annotations

import collections
import socket
import threading

from pdserve.kv_transfer import fp8
from pdserve.kv_transfer.base import KVLayout
from pdserve.kv_transfer.memory import byte_views, paired_runs
from pdserve.kv_transfer.send_queue import Job, Link, QueuedSender
from pdserve.kv_transfer.tcp_receiver import TcpReceiver
from pdserve.kv_transfer.wire import (
    LayerAck,
    LayerHeader,
    ProtocolError,
    client_handshake,
    parse_endpoint,
    recv_frame,
    resolve_secret,
    send_frame,
    shutdown_socket,
)
from pdserve.kv_transfer.wire_faults import TcpFault


class TcpLink(Link):
    """A connected, handshaken socket to one receiver, plus its acknowledgement reader."""

    def __init__(self, sender: TcpSender, endpoint: str) -> None:
        self._sender = sender
        host, port = parse_endpoint(endpoint, sender.scheme)
        timeout = sender.connect_timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ConnectionError(
                f"cannot connect to the KV receiver at {endpoint}: {exc.strerror or exc} "
                "(is the decode worker running, and is the endpoint right?)"
            ) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(sock, sender.layout, sender.secret, sender._hello_extra())
        except TimeoutError:
            sock.close()
            raise ConnectionError(
                f"the KV receiver at {endpoint} did not complete the handshake in {timeout:g} s"
            ) from None
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)  # stalls are bounded by wait()'s timeout, which aborts the link
        self._sock = sock
        self._pending: collections.deque[Job] = collections.deque()
        self._dead = False
        self._acks = threading.Thread(target=self._read_acks, name="kv-acks", daemon=True)
        self._acks.start()

    @property
    def alive(self) -> bool:
        return not self._dead

    def send(self, job: Job) -> None:
        self._pending.append(job)  # before the header: its ack may come back at once
        if self._dead:  # the ack reader already failed what was pending, maybe not this job
            raise ConnectionError("connection to the KV receiver lost")
        header = LayerHeader(job.transfer_id, job.layer, list(job.src_ids), list(job.dst_ids),
                             job.nbytes, self._sender.encoding)  # fmt: skip
        fault = self._sender.fault
        if fault is not None and fault.due():
            fault.inject(self._sock, header)
        send_frame(self._sock, header)
        self._sender._write_payload(self._sock, job)

    def _read_acks(self) -> None:
        tracker = self._sender._tracker
        error = "connection closed"
        try:
            while True:
                ack = recv_frame(self._sock, LayerAck)
                job = self._pending.popleft()
                if (ack.transfer_id, ack.layer) != (job.transfer_id, job.layer):
                    raise ProtocolError("acknowledgement out of order")
                tracker.acked(job.transfer_id, job.nbytes, ack.error)
        except (OSError, ProtocolError, IndexError) as exc:
            error = f"connection to the KV receiver lost: {exc}"
        finally:
            self._dead = True
            while self._pending:
                tracker.fail(self._pending.popleft().transfer_id, error)

    def abort(self) -> None:
        shutdown_socket(self._sock)

    def close(self) -> None:
        shutdown_socket(self._sock)
        self._acks.join(timeout=5)
        self._sock.close()


class TcpSender(QueuedSender):
    """Prefill side of the tcp connector. `secret`: None reads $PDSERVE_SECRET(_FILE)."""

    scheme = "tcp"

    def __init__(
        self,
        layout: KVLayout,
        k_caches,
        v_caches,
        *,
        secret: bytes | None = None,
        connect_timeout_s: float = 5.0,
        compression: str | None = None,
    ) -> None:
        if compression not in (None, fp8.ENCODING):
            raise ValueError(f"unknown KV compression {compression!r}; use None or 'fp8'")
        super().__init__(layout, k_caches, v_caches)
        self.secret = resolve_secret(secret)
        self.connect_timeout_s = connect_timeout_s
        self.encoding = compression or "raw"
        self._k_bytes = byte_views(k_caches)
        self._v_bytes = byte_views(v_caches)
        self.fault = TcpFault.from_env(receiver=False)  # None unless a test switched it on

    def _check_endpoint(self, endpoint: str) -> None:
        parse_endpoint(endpoint, self.scheme)

    def _connect(self, endpoint: str) -> Link:
        return TcpLink(self, endpoint)

    def _hello_extra(self) -> bytes:
        return b""

    def _payload_bytes(self, num_blocks: int) -> int:
        if self.encoding == fp8.ENCODING:
            return fp8.payload_bytes(self.layout, num_blocks)
        return super()._payload_bytes(num_blocks)

    def _write_payload(self, sock: socket.socket, job: Job) -> None:
        """All K blocks of the layer in list order, then all V blocks, from cache memory."""
        if self.encoding == fp8.ENCODING:
            for cache in (self.k_caches[job.layer], self.v_caches[job.layer]):
                for part in fp8.encode(cache, job.src_ids):
                    sock.sendall(part.numpy())
            return
        runs = paired_runs(job.src_ids, job.dst_ids)
        for views in (self._k_bytes[job.layer], self._v_bytes[job.layer]):
            for run in runs:
                sock.sendall(views[run.src : run.src + run.count])


__all__ = ["TcpLink", "TcpReceiver", "TcpSender"]  # the registry finds both sides here
