"""Prometheus exposition of a store's counters (an HTTP /metrics endpoint, optional)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.kv_store.store import Store

# StoreStats fields that are current sizes rather than monotonic counters.
GAUGES = ("dram_blocks", "dram_bytes", "ssd_blocks", "ssd_bytes", "pinned_blocks")


class StoreCollector:
    """Reads `store.stats()` at every scrape: `pdserve_kv_store_<field>`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        stats = self.store.stats()
        for name in stats.__struct_fields__:
            value = float(getattr(stats, name))
            doc = f"KV store {name.replace('_', ' ')}"
            if name in GAUGES:
                yield GaugeMetricFamily(f"pdserve_kv_store_{name}", doc, value=value)
            else:
                yield CounterMetricFamily(f"pdserve_kv_store_{name}", doc, value=value)


def serve_metrics(store: Store, host: str, port: int) -> int:
    """Serve /metrics on host:port (0: a free port) in a daemon thread; return the port."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))  # type: ignore[arg-type]
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port
