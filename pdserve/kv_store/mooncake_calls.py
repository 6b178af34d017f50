"""The Mooncake client's side of the pool's blocking C++ calls (`kv_store/mooncake.py`): each
call on a thread of its own and waited for at most a deadline (`Caller`; a stuck call holds off
the next ones, whose buffers it may still use), registered host memory for staging (`Buffer`),
and what the client saw of the pool (`PoolCounters`, served as Prometheus /metrics by
`serve_counters`).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import queue
import threading
from collections.abc import Callable


class PoolError(OSError):
    """A pool call failed, timed out, or was refused while an earlier one is still stuck."""


class Buffer:
    """Registered host memory: `size` bytes at `ptr`, sliced as memoryviews."""

    def __init__(self, size: int) -> None:
        self.raw = (ctypes.c_char * size)()
        self.ptr, self.size = ctypes.addressof(self.raw), size
        self.view = memoryview(self.raw).cast("B")


class Caller:
    """Runs pool calls on one daemon thread of its own (a stuck call never blocks the process's
    exit), each waited for at most `timeout_s`; while a call is past its deadline the next ones
    fail at once (their buffers must stay untouched)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stuck: cf.Future | None = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # handed to the caller
                    fut.set_exception(exc)

    def __call__(self, timeout_s: float, fn: Callable, *args):
        if self.stuck:
            raise PoolError("an earlier Mooncake call has not returned yet")
        fut: cf.Future = cf.Future()
        self._jobs.put((fut, fn, args))
        try:
            return fut.result(timeout=max(timeout_s, 0.001))
        except cf.TimeoutError:
            self._stuck = fut
            raise PoolError(f"a Mooncake call took over {timeout_s:.1f} s") from None

    @property
    def stuck(self) -> bool:
        return self._stuck is not None and not self._stuck.done()

    def close(self) -> None:
        self._jobs.put(None)


class PoolCounters:
    """What this client saw of the pool (`stats()`; the master's own /metrics has its side)."""

    FIELDS = ("hits", "misses", "evictions_seen", "put_blocks", "put_bytes", "load_bytes",
              "failures", "timeouts")  # fmt: skip

    def __init__(self) -> None:
        for name in self.FIELDS:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.FIELDS}


def serve_counters(counters: PoolCounters, host: str, port: int) -> int:
    """Serve `counters` as `pdserve_kv_pool_<field>_total` on http://host:port/metrics (0: a
    free port) in a daemon thread; return the port."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily

    class Collector:
        def collect(self):
            for name, value in counters.as_dict().items():
                doc = f"Mooncake pool {name.replace('_', ' ')} (this client)"
                yield CounterMetricFamily(f"pdserve_kv_pool_{name}", doc, value=value)

    registry = CollectorRegistry()
    registry.register(Collector())  # type: ignore[arg-type]
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port
