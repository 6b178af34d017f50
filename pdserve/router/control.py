"""The router's end of the control channel: one ZeroMQ ROUTER socket that every worker's
DEALER sockets (its main one and its heartbeat one, "<id>#hb") connect to."""

from __future__ import annotations

import logging
from functools import partial
from typing import Protocol

import zmq
import zmq.asyncio

from pdserve.protocol.channel import Codec

log = logging.getLogger("pdserve.router")


class Channel(Protocol):
    """Where the core's messages go: a ControlSocket, or a recorder in tests."""

    endpoint: str

    def send(self, worker_id: str, msg) -> bool: ...

    def close(self) -> None: ...


class ControlSocket:
    def __init__(self, host: str, port: int, secret: bytes | None = None):
        self.codec = Codec(secret)
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(f"tcp://{host}:{port}")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def send(self, worker_id: str, msg) -> bool:
        """Queue msg for a worker. A dead or unknown peer is logged, never raised."""
        try:
            frames = self.codec.encode(msg)
            fut = self.sock.send_multipart([worker_id.encode(), *frames], flags=zmq.NOBLOCK)
        except (zmq.ZMQError, OverflowError, ValueError) as exc:
            log.warning("could not send %s to %s: %s", type(msg).__name__, worker_id, exc)
            return False
        fut.add_done_callback(partial(_log_send_error, type(msg).__name__, worker_id))
        return True

    async def recv(self) -> tuple[str, object]:
        """The next (sender identity, message) that decodes; bad frames are dropped."""
        while True:
            frames = await self.sock.recv_multipart()
            msg = self.codec.decode(frames[1:])
            if msg is not None:
                return frames[0].decode(), msg

    def close(self) -> None:
        self.sock.close()


def _log_send_error(kind: str, worker_id: str, fut) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("could not send %s to %s: %s", kind, worker_id, fut.exception())
