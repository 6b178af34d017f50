"""Prometheus metrics of the router (workers' load is exported through a collector)."""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import REGISTRY

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TTFT = Histogram("pdserve_ttft_seconds", "time to first token", buckets=_LAT)
ITL = Histogram("pdserve_itl_seconds", "inter-token latency", buckets=_LAT)
E2E = Histogram("pdserve_e2e_seconds", "end-to-end request latency", buckets=_LAT)
REQUESTS = Counter("pdserve_requests", "finished requests", ["status"])
PREFILL_DECISIONS = Counter("pdserve_prefill_decisions", "where prompts were prefilled", ["where"])
KV_BYTES = Counter(
    "pdserve_kv_transfer_bytes",
    "KV bytes pushed prefill -> decode, by wire encoding (raw, or fp8: --kv-compression)",
    ["encoding"],
)
KV_SECONDS = Counter("pdserve_kv_transfer_seconds", "seconds spent pushing KV")
KV_EXPOSED = Histogram(
    "pdserve_kv_transfer_exposed_seconds",
    "per request, time the prefill worker waited for its KV push after the forward pass "
    "(what layer-wise streaming did not hide)",
    buckets=_LAT,
)
DECODE_KV_WAIT = Histogram(
    "pdserve_decode_kv_wait_seconds",
    "decode side: blocks placed -> every layer landed (the lease's wait for remote prefill)",
    buckets=_LAT,
)
REMOTE_PREFILL = Histogram(
    "pdserve_remote_prefill_seconds",
    "Prefill received -> all KV on the decode worker",
    buckets=_LAT,
)
KV_FAILURES = Counter("pdserve_kv_transfer_failures", "KV pushes that failed (prefilled locally)")
WORKER_FAILURES = Counter("pdserve_worker_failures", "workers declared dead")
MIGRATIONS = Counter("pdserve_migrations", "requests replayed on another decode worker")
CACHE_TEMPERATURE = Counter(
    "pdserve_cache_temperature", "requests by cached share of the prompt at placement", ["cache"]
)
TTFT_BY_CACHE = Histogram(
    "pdserve_ttft_by_cache_seconds", "TTFT of warm vs cold requests", ["cache"], buckets=_LAT
)
REJECTED = Counter("pdserve_rejected", "requests refused by admission control", ["reason"])
SCALE_EVENTS = Counter(
    "pdserve_scale_events", "workers the autoscaler started (up) or drained (down)",
    ["role", "direction"],
)  # fmt: skip
AUTOSCALE_TARGET = Gauge(
    "pdserve_autoscale_target_workers", "workers per role the autoscaler last decided on", ["role"]
)
AUTOSCALE_PREDICTED = Gauge(
    "pdserve_autoscale_predicted_seconds",
    "the autoscaler's last prediction for the counts it chose (corrected p90), by metric",
    ["metric"],
)


class WorkerCollector:
    """Exports each live worker's last load report as gauges labelled by worker and role."""

    FIELDS = (
        "waiting",
        "transferring",
        "running",
        "queued_tokens",
        "free_blocks",
        "total_blocks",
        "prefix_hit_tokens",
        "prefix_query_tokens",
        "preemptions",
        "spec_proposed_tokens",
        "spec_accepted_tokens",
        "spec_verify_steps",
        "spec_acceptance_rate",
        "spec_mean_accepted_len",
    )

    def __init__(self, core):
        self.core = core

    def collect(self):
        live = GaugeMetricFamily(
            "pdserve_workers", "live workers per role (draining ones left out)", labels=["role"]
        )
        alive = self.core.alive()
        for role in ("prefill", "decode", "both"):
            live.add_metric([role], sum(w.role == role and not w.draining for w in alive))
        yield live
        families = {
            f: GaugeMetricFamily(f"pdserve_worker_{f}", f"worker {f}", labels=["worker", "role"])
            for f in self.FIELDS
        }
        for w in alive:
            if w.load is None:
                continue
            for f in self.FIELDS:
                families[f].add_metric([w.worker_id, w.role], getattr(w.load, f))
        yield from families.values()


def register_workers(core) -> WorkerCollector:
    collector = WorkerCollector(core)
    REGISTRY.register(collector)
    return collector


def observe_request(state, status: str) -> tuple[float | None, float | None]:
    """Count a finished request (a RequestState) by status and observe its latencies; its
    (TTFT, TPOT) when it had a first token (and a second)."""
    REQUESTS.labels(status).inc()
    ttft = tpot = None
    if state.first_token_at:
        ttft = state.first_token_at - state.created
        TTFT.observe(ttft)
        TTFT_BY_CACHE.labels("warm" if state.warm else "cold").observe(ttft)
        n = len(state.tokens)
        if n > 1:
            tpot = (state.last_token_at - state.first_token_at) / (n - 1)
            ITL.observe(tpot)
    E2E.observe(time.monotonic() - state.created)
    return ttft, tpot


def observe_prefill_done(msg, encoding: str, placed_at: float | None) -> None:
    """A prefill worker's PrefillDone: its KV push (bytes by wire `encoding`, seconds, what the
    forward pass did not hide), how long D's blocks waited since `placed_at`, and a failure."""
    KV_BYTES.labels(encoding).inc(msg.transfer_bytes)
    KV_SECONDS.inc(msg.transfer_s)
    KV_EXPOSED.observe(msg.exposed_s)
    if placed_at is not None:  # D's blocks waited under lease this long
        DECODE_KV_WAIT.observe(time.monotonic() - placed_at)
    REMOTE_PREFILL.observe(msg.prefill_s)
    if msg.first_token is None:
        KV_FAILURES.inc()
