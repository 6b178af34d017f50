"""The put thread: `StoreClient.put`s wait in a bounded queue and are sent one at a time off the
engine's thread.

A put is failed at once (its ticket done, with an error) when the queue is full or closed, so
the engine never waits on the store. `close` fails what is still queued; the put being sent
finishes or fails on its own.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from pdserve.kv_store.tickets import PutJob, PutTicket, TicketBook

_FAILURES = (OSError, ValueError)  # OSError covers ConnectionError, TimeoutError, ProtocolError


class PutQueue:
    """Sends queued `PutJob`s on a thread of its own with `send(job)` (returns the blocks stored;
    raises OSError or ValueError when the put failed, and `drop()` is then called) and finishes
    their tickets."""

    def __init__(
        self, send: Callable[[PutJob], int], drop: Callable[[], None], max_queued: int
    ) -> None:
        self._send, self._drop = send, drop
        self._jobs: queue.Queue[PutJob | None] = queue.Queue(max_queued)
        self._book = TicketBook()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kv-store-put", daemon=True)
        self._thread.start()

    def open(self) -> PutTicket:
        """The ticket for a put about to be submitted; `flush` waits for it from now on."""
        return self._book.open()

    def submit(self, job: PutJob) -> PutTicket:
        """Queue `job`, or fail its ticket at once (queue full or closed)."""
        if self._closed:
            self._book.finish(job.ticket, 0, "KV store client closed")
            return job.ticket
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            msg = "put queue full: the KV store is slower than the engine"
            self._book.finish(job.ticket, 0, msg)
        return job.ticket

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every ticket opened so far is done; False on timeout."""
        return self._book.wait_all(timeout_s)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                stored = self._send(job)
                self._book.finish(job.ticket, stored, None)
            except _FAILURES as exc:
                self._drop()
                self._book.finish(job.ticket, 0, f"KV store put failed: {exc}")

    def close(self, join_timeout_s: float) -> None:
        """Fail the queued puts and later submits; wait up to `join_timeout_s` for the thread."""
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._book.finish(job.ticket, 0, "KV store client closed")
        self._jobs.put(None)
        self._thread.join(timeout=join_timeout_s)
