"""A listening TCP socket with one thread per accepted connection, shared by the tcp receiver
and the KV store server.

`serve(conn, addr)` runs on the connection's own thread; when it returns (or raises) the
connection is forgotten and closed. A connection beyond `max_connections`, or one accepted while
closing, goes to `turn_away(conn, addr)` instead (which may tell the peer why) and is closed.
`close()` stops accepting, cuts every connection (waking threads blocked on them) and joins them.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from pdserve.kv_transfer.wire import shutdown_socket

log = logging.getLogger("pdserve.kv_transfer")
Handler = Callable[[socket.socket, object], None]


class Acceptor:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        serve: Handler,
        turn_away: Handler,
        max_connections: int,
        name: str,
    ) -> None:
        self._serve, self._turn_away = serve, turn_away
        self.max_connections = max_connections
        self._name = name
        self._listener = socket.create_server((host, port))
        self.host, self.port = host, self._listener.getsockname()[1]
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None

    def endpoint(self, scheme: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept_loop, name=self._name, daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return  # listener closed by close()
            with self._lock:
                full = self._closed or len(self._conns) >= self.max_connections
                if not full:
                    thread = threading.Thread(target=self._run, args=(conn, addr), daemon=True)
                    self._conns[conn] = thread
            if full:
                self._refuse(conn, addr)
            else:
                thread.start()

    def _refuse(self, conn: socket.socket, addr) -> None:
        try:
            self._turn_away(conn, addr)
        except OSError:
            pass  # the peer is gone already
        finally:
            conn.close()

    def _run(self, conn: socket.socket, addr) -> None:
        try:
            self._serve(conn, addr)
        except Exception:  # the handler's bug must cost one connection, not the server
            log.exception("%s: error serving %s", self._name, addr)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = dict(self._conns)
        shutdown_socket(self._listener)  # wakes accept(); close() alone does not on Linux
        self._listener.close()
        for conn in conns:
            shutdown_socket(conn)
        for thread in [*conns.values(), self._thread]:
            if thread is not None:
                thread.join(timeout=5)
