"""Test-only wire faults of the tcp KV connector (`PDSERVE_KV_FAULT`; see `TcpFault`)."""

from __future__ import annotations

import socket
import threading

from pdserve import envs
from pdserve.kv_transfer.wire import LayerHeader, send_frame, wait_hangup

STALL_S = 120.0  # a stalled receiver waits this long at most for the sender to give up
RECEIVER_KINDS = ("stall",)


class TcpFault:
    """Test-only fault injection between real processes (`PDSERVE_KV_FAULT=KIND[+KIND...]:
    EVERY`): every EVERY-th layer goes wrong on the wire, each time as the next of the KINDs.
    Sender side: reset: half the payload, then the connection is reset (RST); truncate: half
    the payload, then the sender closes its side (EOF mid-frame); corrupt: a frame of garbage
    where the layer's header belongs. Receiver side: stall: the receiver stops reading after a
    layer's header until the sender hangs up (its transfer timeout; `STALL_S` at most), lands
    nothing and drops the connection. Everything above (acks, timeouts, leases, local
    fallback) must cope."""

    def __init__(self, kinds: tuple[str, ...], every: int) -> None:
        self.kinds, self.every = kinds, every
        self._count = 0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, receiver: bool) -> TcpFault | None:
        """The switched-on fault if it is one of this side's (None otherwise)."""
        spec = envs.kv_fault()
        if spec is None or (spec[0][0] in RECEIVER_KINDS) != receiver:
            return None
        return cls(*spec)

    def due(self) -> str | None:
        """How this layer breaks (the KINDs in turn), or None: it goes through."""
        with self._lock:
            self._count += 1
            if self._count % self.every:
                return None
            return self.kinds[(self._count // self.every - 1) % len(self.kinds)]

    def inject(self, sock: socket.socket, header: LayerHeader, kind: str) -> None:
        """Sender side: break this layer on the wire as `kind` (its bytes do not matter: it
        fails)."""
        if kind == "corrupt":
            sock.sendall((64).to_bytes(4, "big") + b"\xff" * 64)  # not a msgpack LayerHeader
        else:
            send_frame(sock, header)
            sock.sendall(bytes(header.nbytes // 2))
            if kind == "reset":  # SO_LINGER 0: close sends RST, not FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            else:
                sock.shutdown(socket.SHUT_WR)
        raise ConnectionError(f"injected KV fault: {kind} ({envs.KV_FAULT})")

    def stall(self, conn: socket.socket) -> None:
        """Receiver side: stop reading until the sender hangs up, then drop the connection
        (nothing landed)."""
        wait_hangup(conn, STALL_S)
        raise ConnectionError(f"injected KV fault: stall ({envs.KV_FAULT})")
