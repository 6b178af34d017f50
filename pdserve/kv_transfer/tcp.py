"""The built-in TCP connector, sender side: header frame + raw block bytes straight from cache
memory, one acknowledgement per layer (receiver side: tcp_receiver.py; protocol: wire.py).

Each sender keeps one persistent connection per receiver endpoint, written by that endpoint's
channel thread (send_queue.py) while a second thread reads acknowledgements.
"""

from __future__ import annotations

import collections
import socket
import threading

import torch

from pdserve.kv_transfer import fp8
from pdserve.kv_transfer.layout import KVLayout, whole_rank
from pdserve.kv_transfer.memory import byte_views, gather_heads, layer_caches, paired_runs
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
    """A connected, handshaken socket to one receiver, plus its acknowledgement reader.

    The handshake tells the receiver's layout: which rank of which tensor-parallel group, so
    which KV heads its blocks hold (`dest`, and `segments`: where each comes from here)."""

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
            dest = client_handshake(sock, sender.layout, sender.secret, sender._hello_extra())
            if dest is None:
                raise ConnectionError(f"{endpoint} is not a KV receiver (it sent no layout)")
            self.dest = dest
            self.segments = dest.segments_from(sender.layout)
            self.whole = whole_rank(self.segments, dest, sender.layout)
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
        self._pending: collections.deque[tuple[Job, int]] = collections.deque()
        self._dead = False
        self._acks = threading.Thread(target=self._read_acks, name="kv-acks", daemon=True)
        self._acks.start()

    @property
    def alive(self) -> bool:
        return not self._dead

    def send(self, job: Job) -> None:
        nbytes = self._sender._payload_bytes(len(job.src_ids), self.dest)
        self._pending.append((job, nbytes))  # before the header: its ack may come back at once
        if self._dead:  # the ack reader already failed what was pending, maybe not this job
            raise ConnectionError("connection to the KV receiver lost")
        header = LayerHeader(job.transfer_id, job.layer, list(job.src_ids), list(job.dst_ids),
                             nbytes, self._sender.encoding)  # fmt: skip
        fault = self._sender.fault
        kind = fault.due() if fault is not None else None
        if kind is not None:
            fault.inject(self._sock, header, kind)
        send_frame(self._sock, header)
        self._sender._write_payload(self._sock, job, self)

    def _read_acks(self) -> None:
        tracker = self._sender._tracker
        error = "connection closed"
        try:
            while True:
                ack = recv_frame(self._sock, LayerAck)
                job, nbytes = self._pending.popleft()
                if (ack.transfer_id, ack.layer) != (job.transfer_id, job.layer):
                    raise ProtocolError("acknowledgement out of order")
                tracker.acked(job.transfer_id, nbytes, ack.error)
        except (OSError, ProtocolError, IndexError) as exc:
            error = f"connection to the KV receiver lost: {exc}"
        finally:
            self._dead = True
            while self._pending:
                tracker.fail(self._pending.popleft()[0].transfer_id, error)

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
        ranks=None,
    ) -> None:
        if compression not in (None, fp8.ENCODING):
            raise ValueError(f"unknown KV compression {compression!r}; use None or 'fp8'")
        super().__init__(layout, k_caches, v_caches, ranks)
        self.secret = resolve_secret(secret)
        self.connect_timeout_s = connect_timeout_s
        self.encoding = compression or "raw"
        self._bytes = [(byte_views(k), byte_views(v)) for k, v in self.ranks]  # v: [] if latent
        self.fault = TcpFault.from_env(receiver=False)  # None unless a test switched it on

    def _check_endpoint(self, endpoint: str) -> None:
        parse_endpoint(endpoint, self.scheme)

    def _connect(self, endpoint: str) -> Link:
        return TcpLink(self, endpoint)

    def _hello_extra(self) -> bytes:
        return b""

    def _payload_bytes(self, num_blocks: int, dest: KVLayout | None = None) -> int:
        if self.encoding == fp8.ENCODING:
            return fp8.payload_bytes(dest or self.layout, num_blocks)
        return super()._payload_bytes(num_blocks, dest)

    def _write_payload(self, sock: socket.socket, job: Job, link: TcpLink) -> None:
        """All K blocks of the layer in list order, then all V blocks (or the latent's blocks
        alone: every rank holds it whole, so it is never gathered): the receiver's heads,
        from cache memory in place when one rank's blocks are the receiver's as they are, else
        gathered from the ranks that hold them (`memory.gather_heads`)."""
        if link.whole is not None and self.encoding != fp8.ENCODING:
            runs = paired_runs(job.src_ids, job.dst_ids)
            for views in layer_caches(*self._bytes[link.whole], job.layer):
                for run in runs:
                    sock.sendall(views[run.src : run.src + run.count])
            return
        for which in range(self.layout.tensors):  # K, then V (or the latent alone)
            if link.whole is not None:
                blocks, ids = self.ranks[link.whole][which][job.layer], job.src_ids
            else:
                caches = [rank[which] for rank in self.ranks]
                heads = link.dest.num_kv_heads
                blocks = gather_heads(caches, job.layer, job.src_ids, link.segments, heads)
                ids = range(len(job.src_ids))
            if self.encoding == fp8.ENCODING:
                for part in fp8.encode(blocks, ids):
                    sock.sendall(part.numpy())
            else:  # gathered: contiguous, in the order of the ids
                sock.sendall(blocks.reshape(-1).view(torch.uint8).numpy())


__all__ = ["TcpLink", "TcpReceiver", "TcpSender"]  # the registry finds both sides here
