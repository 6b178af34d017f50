"""The store process: a thread per client connection in front of one `Store`.

Each connection is handshaken like a KV fabric link (wire.py: version, the client's layout,
HMAC with the shared secret when the store has one) and then serves requests in order
(protocol.py) through a `Session` (session.py). A store started with `transport="nixl"` also
moves block bytes by NIXL READs for clients that bring a NIXL agent (nixl.py); tcp clients are
served as before.

Idle connections may stay open indefinitely; once a request has started, every socket
operation is bounded by `io_timeout_s`, so a client that stalls mid-request cannot hold
pinned blocks or a thread for longer than that. A connection's lookup lease ends at its next
request or when it closes.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from pathlib import Path

from pdserve.kv_store.config import GB, StoreConfig, payload_bytes
from pdserve.kv_store.protocol import Error, recv_request, send_msg
from pdserve.kv_store.session import Session
from pdserve.kv_store.store import Store
from pdserve.kv_transfer.acceptor import Acceptor
from pdserve.kv_transfer.registry import TRANSPORTS
from pdserve.kv_transfer.wire import (
    HOW_TO_SET_SECRET,
    HandshakeRefused,
    ProtocolError,
    check_secret,
    is_loopback,
    resolve_secret,
    server_handshake,
)

log = logging.getLogger("pdserve.kv_store")
MAX_BLOCK_BYTES = 256 << 20  # one block of any real model is far smaller; refuse absurd layouts


class StoreServer:
    """Serves a `Store` on `host:port` (port 0: a free one). A non-loopback host needs a secret
    (argument, or $PDSERVE_SECRET / $PDSERVE_SECRET_FILE)."""

    def __init__(
        self,
        store: Store,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes | None = None,
        io_timeout_s: float = 30.0,
        transport: str = "tcp",
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown KV store transport {transport!r}; use tcp or nixl")
        self.secret = resolve_secret(secret)
        if self.secret is None and not is_loopback(host):
            raise ValueError(
                f"refusing to serve the KV store on {host} (not loopback) without "
                f"authentication; {HOW_TO_SET_SECRET} (or pass --secret-file)"
            )
        self.store = store
        self.io_timeout_s = io_timeout_s
        self.transport = transport
        self.nixl = None
        if transport == "nixl":
            # The one import of the nixl data path, here rather than at the top: it imports
            # torch (through kv_transfer.nixl), about 2 s that a tcp store never needs to pay.
            # Everything else nixl goes through this NixlStoreServer.
            from pdserve.kv_store.nixl import NixlStoreServer

            self.nixl = NixlStoreServer(store.config.dram_bytes)
            store.alloc = self.nixl.arena.alloc  # the DRAM tier lives in registered memory
        self._acceptor = Acceptor(
            host,
            port,
            serve=self._serve,
            turn_away=self._turn_away,
            max_connections=store.config.max_connections,
            name="kv-store",
        )

    @property
    def endpoint(self) -> str:
        return self._acceptor.endpoint(self.transport)

    def start(self) -> None:
        self._acceptor.start()

    @staticmethod
    def _turn_away(conn: socket.socket, addr) -> None:
        log.warning("KV store: refusing connection from %s (limit reached)", addr)

    def _serve(self, conn: socket.socket, addr) -> None:
        session = peer = None
        try:
            conn.settimeout(self.io_timeout_s)
            hello = server_handshake(conn, None, self.secret)  # every layout: it is in each key
            if payload_bytes(hello.layout) > MAX_BLOCK_BYTES:
                raise ProtocolError(f"a block of this layout exceeds {MAX_BLOCK_BYTES} bytes")
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.nixl is not None:
                peer = self.nixl.on_hello(hello, hello.layout)
            session = Session(self.store, conn, hello.layout, self.io_timeout_s, self.nixl, peer)
            while self._wait_request(conn, session):
                session.handle(recv_request(conn))
        except HandshakeRefused as exc:
            log.warning("KV store: refused client %s: %s", addr, exc)
        except ProtocolError as exc:
            log.warning("KV store: dropping client %s: %s", addr, exc)
            self._try_send_error(conn, str(exc))
        except OSError as exc:  # disconnects and timeouts
            log.debug("KV store: client %s gone: %s", addr, exc)
        finally:
            if session is not None:
                session.close()
            if self.nixl is not None:
                self.nixl.on_closed(peer)

    def _wait_request(self, conn: socket.socket, session: Session) -> bool:
        """Block without a deadline until the next request starts; False when the peer left.
        While the client READs blocks of a nixl load, wait at most `io_timeout_s`, driving
        the store's UCX progress (the READ's wire-up needs it)."""
        if session.held is not None:
            self.nixl.wait_readable(conn, self.io_timeout_s)  # type: ignore[union-attr]
        conn.settimeout(None)
        more = conn.recv(1, socket.MSG_PEEK) != b""
        conn.settimeout(self.io_timeout_s)
        return more

    @staticmethod
    def _try_send_error(conn: socket.socket, reason: str) -> None:
        try:
            send_msg(conn, Error(reason))
        except OSError:
            pass  # the peer is gone already

    def close(self) -> None:
        """Stop accepting, cut every connection, join the threads."""
        self._acceptor.close()
        if self.nixl is not None:
            self.nixl.close()


def read_secret_file(path: str) -> bytes:
    """The shared secret in `path` (surrounding whitespace stripped); ValueError if unusable."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the secret file {path}: {exc.strerror}") from exc
    check_secret(secret)
    return secret


def serve_until_signalled(
    config: StoreConfig,
    host: str,
    port: int,
    secret: bytes | None,
    metrics_port: int | None,
    transport: str = "tcp",
) -> int:
    """The store process: recover, serve, print the endpoint, run until SIGTERM/SIGINT."""
    store = Store(config)
    server = StoreServer(store, host, port, secret=secret, transport=transport)
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    extra = ""
    if metrics_port is not None:
        from pdserve.kv_store.metrics import serve_metrics

        extra = f", metrics on http://{host}:{serve_metrics(store, host, metrics_port)}/metrics"
    stats = store.stats()
    print(
        f"pdserve store: listening on {server.endpoint} ({stats.ssd_blocks} blocks recovered "
        f"from {config.store_dir}; DRAM {config.dram_bytes / GB:g} GiB, "
        f"SSD {config.ssd_bytes / GB:g} GiB){extra}",
        flush=True,
    )
    while not stop.wait(1.0):
        pass
    server.close()
    return 0
