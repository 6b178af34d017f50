"""A client's connection to the store: connected on first use, handshaken, dropped on any error.

After a failed connect the store is not retried for `retry_after_s`, so an engine whose store is
down pays one fast failure per call, not a connect timeout per engine step. The endpoint's scheme
(tcp:// or nixl://) only tells the caller which data path to use: the socket is the same.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.wire import client_handshake, parse_endpoint

T = TypeVar("T")


class Deadline:
    """An absolute point in time (monotonic clock) that socket operations must not pass."""

    def __init__(self, timeout_s: float) -> None:
        self.at = time.monotonic() + timeout_s

    def apply(self, sock: socket.socket) -> None:
        """Bound the next socket operation by the time left (TimeoutError if none is)."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(left)


def recv_into_by(sock: socket.socket, view: memoryview, deadline: Deadline) -> None:
    """Fill `view` from the socket (straight into the caller's memory) before `deadline`."""
    got, n = 0, len(view)
    while got < n:
        deadline.apply(sock)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"the KV store closed the connection ({got} of {n} bytes read)")
        got += k


class Connection:
    """One socket to the store. Not thread-safe: each user thread holds its own."""

    def __init__(
        self,
        endpoint: str,
        layout: KVLayout,
        secret: bytes | None,
        connect_timeout_s: float,
        retry_after_s: float,
        *,
        extra: bytes = b"",
        on_connect: Callable[[socket.socket], None] | None = None,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._addr = parse_endpoint(endpoint, "nixl" if endpoint.startswith("nixl://") else "tcp")
        self._layout, self._secret = layout, secret
        self._extra = extra  # the hello's backend data (a nixl client's agent)
        # after the handshake; at the drop of a connection it ran for (any that was handed out)
        self._on_connect, self._on_drop = on_connect, on_drop
        self._connect_timeout_s, self._retry_after_s = connect_timeout_s, retry_after_s
        self._sock: socket.socket | None = None
        self._down_until = 0.0
        self._down_reason = ""

    def get(self) -> socket.socket:
        """The connected socket; ConnectionError (at once while backing off) if unreachable."""
        if self._sock is not None:
            return self._sock
        if time.monotonic() < self._down_until:
            raise ConnectionError(self._down_reason)
        try:
            sock = socket.create_connection(self._addr, timeout=self._connect_timeout_s)
        except OSError as exc:
            self._back_off(f"cannot connect to the KV store at {self.endpoint}: {exc}")
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(sock, self._layout, self._secret, self._extra)
            if self._on_connect is not None:
                self._on_connect(sock)
        except OSError as exc:  # includes HandshakeRefused, StoreError and timeouts
            sock.close()
            self._back_off(f"handshake with the KV store at {self.endpoint} failed: {exc}")
        self._sock = sock
        return sock

    @property
    def backing_off(self) -> bool:
        """A connect failed less than `retry_after_s` ago: calls fail at once for now."""
        return self._sock is None and time.monotonic() < self._down_until

    def call(self, fn: Callable[[socket.socket], T]) -> T:
        """`fn(sock)`; run once more on a new connection if a connection opened earlier turns
        out closed by the store (it restarted, or dropped us while idle). Requests are
        idempotent, so repeating one is safe."""
        reused = self._sock is not None
        try:
            return fn(self.get())
        except ConnectionError as exc:
            self.drop()
            if not reused or not _closed_by_peer(exc):
                raise
        return fn(self.get())

    def _back_off(self, reason: str):
        self._down_until = time.monotonic() + self._retry_after_s
        self._down_reason = f"{reason} (not retried for {self._retry_after_s:g} s)"
        raise ConnectionError(self._down_reason) from None

    def drop(self) -> None:
        """Close after a failure or a timeout: where the stream stands is unknown."""
        if self._sock is None:
            return
        self._sock.close()
        self._sock = None
        if self._on_drop is not None:
            self._on_drop()


def _closed_by_peer(exc: ConnectionError) -> bool:
    """A reset or an orderly close, as opposed to a refusal or a protocol violation."""
    closed = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
    return isinstance(exc, closed) or type(exc) is ConnectionError
