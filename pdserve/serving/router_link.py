"""A worker's control connections: one `RouterLink` per router it serves, and `Routers`, which
sends each message to the router that placed its request."""

from __future__ import annotations

import logging
import time

import zmq

from pdserve.protocol import messages as m
from pdserve.protocol.channel import Codec

log = logging.getLogger("pdserve.worker")
SEND_QUEUE = 100_000  # messages queued for a router before they are dropped (it is gone)


class RouterLink:
    """This worker's control connection to one router: when it last spoke, and whether the
    worker dropped its requests after a silence (it registers again when the router speaks)."""

    def __init__(self, endpoint: str, worker_id: str) -> None:
        self.endpoint = endpoint
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        self.sock.connect(endpoint)
        self.seen = time.monotonic()
        self.orphaned = False
        self.shut_down = False  # the router told this worker to stop (it is shutting down)

    def send(self, frames: list[bytes]) -> None:
        """Queue a message; never blocks the engine loop on a router that is gone (one that
        has SEND_QUEUE messages unread is: its requests are dropped when its silence times
        out)."""
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("the router at %s reads nothing: message dropped", self.endpoint)


class Routers:
    """Every router this worker serves, and which of them placed each request here."""

    def __init__(self, endpoints: tuple[str, ...], worker_id: str, codec: Codec) -> None:
        self.codec = codec
        self.links = [RouterLink(r, worker_id) for r in endpoints]
        self.owner: dict[str, RouterLink] = {}  # request -> the router that placed it here

    def send(self, msg) -> None:
        """To the router that placed the message's request (to every router if none did); a
        batch of tokens is split between the routers whose requests it carries."""
        if isinstance(msg, m.Tokens) and len(self.links) > 1:
            parts: dict[RouterLink | None, list[m.TokenOut]] = {}
            for item in msg.items:
                parts.setdefault(self.owner.get(item.request_id), []).append(item)
            for link, items in parts.items():
                for target in [link] if link is not None else self.links:
                    target.send(self.codec.encode(m.Tokens(msg.worker_id, items)))
            return
        link = self.owner.get(getattr(msg, "request_id", None))
        for target in [link] if link is not None else self.links:
            target.send(self.codec.encode(msg))

    def send_to(self, link: RouterLink, msg) -> None:
        link.send(self.codec.encode(msg))

    def requests_of(self, link: RouterLink) -> list[str]:
        return [rid for rid, owner in self.owner.items() if owner is link]

    def forget(self, live: set[str]) -> None:
        """Drop the owners of requests that left this worker (not in `live`)."""
        for rid in [rid for rid in self.owner if rid not in live]:
            del self.owner[rid]

    def close(self, linger_ms: int = 1000) -> None:
        """Close every link; the last messages (Leaving) get `linger_ms` to go out (a router
        that is there takes them at once: the wait is only for one that is gone)."""
        for link in self.links:
            link.sock.setsockopt(zmq.LINGER, linger_ms)
            link.sock.close()
