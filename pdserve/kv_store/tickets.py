"""Bookkeeping of asynchronous puts: one ticket per `put`, and a way to wait for all of them."""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

from pdserve.kv_store.protocol import BlockMeta


class PutTicket:
    """The outcome of one `put`. Until `done()`, the put thread may still read its blocks."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.stored = 0  # blocks the store did not hold before
        self.error: str | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once done (stored or failed); False if `timeout_s` passed first."""
        return self._event.wait(timeout_s)

    @property
    def ok(self) -> bool:
        return self.done() and self.error is None


class PutJob(NamedTuple):
    metas: list[BlockMeta]
    sources: list  # per block: its cache block id, or a copy of its bytes (K0 V0 K1 V1 ...)
    ticket: PutTicket


class TicketBook:
    """Counts open tickets so that `wait_all` can wait for every put issued so far."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = 0

    def open(self) -> PutTicket:
        with self._cond:
            self._open += 1
        return PutTicket()

    def finish(self, ticket: PutTicket, stored: int, error: str | None) -> None:
        ticket.stored, ticket.error = stored, error
        ticket._event.set()
        with self._cond:
            self._open -= 1
            self._cond.notify_all()

    def wait_all(self, timeout_s: float | None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._open:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True
