"""The built-in TCP connector, receiver side: one thread per sender connection, each layer's
bytes received with `recv_into` straight into the destination blocks (no staging copy), under a
write ticket of the TransferTable; one acknowledgement per layer (protocol: wire.py).
"""

from __future__ import annotations

import logging
import socket
import time

from pdserve.kv_transfer import fp8
from pdserve.kv_transfer.acceptor import Acceptor
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.memory import layer_caches, paired_runs
from pdserve.kv_transfer.transfer_table import TableReceiver, WriteTicket
from pdserve.kv_transfer.wire import (
    HOW_TO_SET_SECRET,
    ClientHello,
    HandshakeRefused,
    LayerAck,
    LayerHeader,
    ProtocolError,
    Refuse,
    is_loopback,
    recv_frame,
    recv_into_exact,
    resolve_secret,
    send_frame,
    server_handshake,
    shutdown_socket,
)
from pdserve.kv_transfer.wire_faults import TcpFault

log = logging.getLogger("pdserve.kv_transfer")


class TcpReceiver(TableReceiver):
    """Decode side of the tcp connector. Binds at construction (so `endpoint` is known at once);
    a non-loopback `host` needs a secret (argument, or $PDSERVE_SECRET / $PDSERVE_SECRET_FILE).
    """

    scheme = "tcp"
    encodings = ("raw", fp8.ENCODING)  # what this receiver accepts in LayerHeader.encoding

    def __init__(
        self,
        layout: KVLayout,
        k_caches,
        v_caches,
        host: str = "127.0.0.1",
        *,
        port: int = 0,
        secret: bytes | None = None,
        max_connections: int = 64,
        handshake_timeout_s: float = 10.0,
    ) -> None:
        self.secret = resolve_secret(secret)
        if self.secret is None and not is_loopback(host):
            raise ValueError(
                f"refusing to accept KV transfers on {host} (not loopback) without "
                f"authentication; {HOW_TO_SET_SECRET}"
            )
        super().__init__(layout, k_caches, v_caches)
        self._handshake_timeout_s = handshake_timeout_s
        self._fault = TcpFault.from_env(receiver=True)  # None unless a test switched it on
        self._scratch = bytearray(1 << 20)  # late or refused data is read into this and dropped
        self._acceptor = Acceptor(
            host,
            port,
            serve=self._serve,
            turn_away=self._turn_away,
            max_connections=max_connections,
            name="kv-accept",
        )

    @property
    def endpoint(self) -> str:
        return self._acceptor.endpoint(self.scheme)

    def start(self) -> None:
        self._acceptor.start()

    def _turn_away(self, conn: socket.socket, addr) -> None:
        reason = f"the KV receiver is at its limit of {self._acceptor.max_connections} connections"
        log.warning("KV receiver: refusing %s: %s", addr, reason)
        conn.settimeout(0.1)
        send_frame(conn, Refuse(reason))  # the sender's wait reports this instead of EOF

    def _serve(self, conn: socket.socket, addr) -> None:
        peer = None
        try:
            conn.settimeout(self._handshake_timeout_s)  # a silent peer must not hold a slot
            hello = server_handshake(conn, self.layout, self.secret)
            peer = self._on_peer(hello)
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                header = recv_frame(conn, LayerHeader)
                if self._fault is not None and self._fault.due():
                    self._fault.stall(conn)
                error = self._receive_layer(conn, header, peer)
                send_frame(conn, LayerAck(header.transfer_id, header.layer, error))
        except HandshakeRefused as exc:
            self._stats.add(failures=1)
            log.warning("KV receiver: refused sender %s: %s", addr, exc)
        except ProtocolError as exc:
            log.warning("KV receiver: dropping sender %s: %s", addr, exc)
        except OSError as exc:  # includes peer disconnects and timeouts
            log.debug("KV receiver: sender %s disconnected: %s", addr, exc)
        except Exception:  # e.g. a NIXL error: drop this connection, keep serving the others
            log.exception("KV receiver: connection from %s failed", addr)
        finally:
            self._on_peer_closed(peer)

    def _receive_layer(self, conn: socket.socket, hdr: LayerHeader, peer) -> str | None:
        """Land one layer (or discard it); return the error to acknowledge it with."""
        n = len(hdr.dst_block_ids)
        if (
            len(hdr.transfer_id) > 256
            or len(hdr.src_block_ids) != n
            or not 0 <= hdr.layer < self.layout.num_layers
            or hdr.encoding not in self.encodings
            or hdr.nbytes != self._payload_bytes(n, hdr.encoding)
        ):  # the stream cannot be trusted past a header that lies about its payload
            raise ProtocolError(f"inconsistent layer header for {hdr.transfer_id[:256]!r}")
        ticket = self._table.begin_write(
            hdr.transfer_id, hdr.layer, hdr.dst_block_ids, abort=lambda: shutdown_socket(conn)
        )
        if isinstance(ticket, str):
            self._skip_payload(conn, hdr)
            return ticket
        t0 = time.perf_counter()
        try:
            self._land(conn, hdr, ticket, peer)
        except BaseException as exc:
            self._table.end_write(ticket, f"connection lost mid-layer {hdr.layer}: {exc}", 0, 0)
            raise
        return self._table.end_write(ticket, None, hdr.nbytes, time.perf_counter() - t0)

    def _payload_bytes(self, num_blocks: int, encoding: str) -> int:
        if encoding == fp8.ENCODING:
            return fp8.payload_bytes(self.layout, num_blocks)
        return self.layout.tensors * num_blocks * self.layout.block_bytes

    def _land(self, conn: socket.socket, hdr: LayerHeader, ticket: WriteTicket, peer) -> None:
        if hdr.encoding == fp8.ENCODING:
            self._land_fp8(conn, hdr, ticket)
            return
        runs = paired_runs(hdr.src_block_ids, hdr.dst_block_ids)
        bb = self.layout.block_bytes
        for views in layer_caches(self._k_bytes, self._v_bytes, hdr.layer):
            for run in runs:
                if ticket.released:  # released mid-layer: the rest goes to scratch
                    self._discard(conn, run.count * bb)
                else:
                    span = views[run.dst : run.dst + run.count]
                    recv_into_exact(conn, memoryview(span).cast("B"))

    def _land_fp8(self, conn: socket.socket, hdr: LayerHeader, ticket: WriteTicket) -> None:
        """Compressed blocks cannot land in place: stage the layer, then dequantize into blocks
        (under the ticket, so `release` still waits for it)."""
        buf = bytearray(hdr.nbytes)
        recv_into_exact(conn, memoryview(buf))
        if ticket.released or not hdr.dst_block_ids:
            return
        parts = fp8.split_payload(buf, self.layout, len(hdr.dst_block_ids))
        for cache, (scales, data) in zip(
            layer_caches(self.k_caches, self.v_caches, hdr.layer), parts, strict=True
        ):
            fp8.decode_into(cache, hdr.dst_block_ids, scales, data)

    def _skip_payload(self, conn: socket.socket, hdr: LayerHeader) -> None:
        self._discard(conn, hdr.nbytes)

    def _discard(self, conn: socket.socket, nbytes: int) -> None:
        scratch = memoryview(self._scratch)
        while nbytes > 0:
            k = min(nbytes, len(scratch))
            recv_into_exact(conn, scratch[:k])
            nbytes -= k

    def _on_peer(self, hello: ClientHello):
        """Backend hook: per-connection state from the sender's hello (nixl: its agent)."""
        return None

    def _on_peer_closed(self, peer) -> None:
        """Backend hook: the connection that `_on_peer` set up is gone."""

    def close(self) -> None:
        self._acceptor.close()
