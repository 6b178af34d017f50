"""Prometheus metrics of the router (workers' load is exported through a collector).

Two sets of names: pdserve's own (`pdserve_*`), and vLLM's (`vllm:*`, labelled `model_name`
and `role`) where the meaning is the same, so that dashboards built for vLLM chart pdserve as
they are (docs/observability.md lists both)."""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
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
KV_FAILURE_CAUSES = ("transport", "timeout", "lease_expired", "layout_refused", "staging_full")
KV_FAILURES_BY_CAUSE = Counter(
    "pdserve_kv_transfer_failures_by_cause",
    "KV handoffs that failed, by cause: transport (the push broke), timeout (not acknowledged "
    "within --transfer-timeout-s), lease_expired (the decode worker gave up waiting and "
    "prefilled locally), layout_refused (a worker whose KV layout or transport no peer can take), "
    "staging_full (no host staging blocks on the prefill worker)",
    ["cause"],
)
for _cause in KV_FAILURE_CAUSES:  # every cause is a series from the start, at 0
    KV_FAILURES_BY_CAUSE.labels(_cause)
_BYTES = tuple(float(1 << k) for k in range(16, 34, 2))  # 64 KiB .. 4 GiB
KV_REQUEST_BYTES = Histogram(
    "pdserve_kv_transfer_request_bytes", "per request, KV bytes pushed prefill -> decode",
    buckets=_BYTES,
)  # fmt: skip
KV_REQUEST_SECONDS = Histogram(
    "pdserve_kv_transfer_request_seconds",
    "per request, first layer queued -> last layer acknowledged",
    buckets=_LAT,
)
KV_REQUEST_GBPS = Histogram(
    "pdserve_kv_transfer_request_gbps", "per request, KV bytes / push seconds, in GB/s",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
)  # fmt: skip
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


# vLLM's names (vllm/v1/metrics/loggers.py), observed by the router per request. `role` is the
# role of the worker that did the work: the decode worker's for latencies and output tokens,
# the prefill worker's ("prefill") for the prompt tokens of a remote prefill.
_VLLM = ["model_name", "role"]
_TOKEN_LAT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10)
VLLM_TTFT = Histogram(
    "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _VLLM,
    buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5,
             7.5, 10, 20, 40, 80, 160, 640, 2560),
)  # fmt: skip
VLLM_ITL = Histogram(
    "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _VLLM,
    buckets=_TOKEN_LAT,
)  # fmt: skip
VLLM_E2E = Histogram(
    "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _VLLM,
    buckets=(0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480,
             960, 1920, 7680),
)  # fmt: skip
VLLM_PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", _VLLM)
VLLM_GENERATION_TOKENS = Counter(
    "vllm:generation_tokens", "Number of generation tokens processed.", _VLLM
)
VLLM_SUCCESS = Counter(
    "vllm:request_success", "Count of successfully processed requests.",
    [*_VLLM, "finished_reason"],
)  # fmt: skip


# (kind, name, help, value of a worker's Load): vLLM's per-engine gauges and counters
VLLM_ENGINE_FAMILIES = (
    (GaugeMetricFamily, "vllm:num_requests_running",
     "Number of requests in model execution batches.", lambda load: load.running),
    (GaugeMetricFamily, "vllm:num_requests_waiting",
     "Number of requests waiting to be processed.",
     lambda load: load.waiting + load.transferring),
    (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
     lambda load: 1 - load.free_blocks / load.total_blocks if load.total_blocks else 0.0),
    (CounterMetricFamily, "vllm:prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens.",
     lambda load: load.prefix_query_tokens),
    (CounterMetricFamily, "vllm:prefix_cache_hits",
     "Prefix cache hits, in terms of number of cached tokens.",
     lambda load: load.prefix_hit_tokens),
    (CounterMetricFamily, "vllm:num_preemptions",
     "Cumulative number of preemption from the engine.", lambda load: load.preemptions),
)  # fmt: skip


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

    def __init__(self, core, model_name: str = ""):
        self.core, self.model_name = core, model_name

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
        yield from self.vllm_families(alive)

    def vllm_families(self, alive):
        """vLLM's engine gauges and counters, one series per worker (`engine`, as vLLM labels
        each engine of a server): requests running and waiting (those waiting for their KV
        included, as vLLM's WAITING_FOR_REMOTE_KVS), KV cache usage (0..1), prefix cache
        queries and hits in tokens, preemptions."""
        families = [
            (kind(name, doc, labels=["model_name", "role", "engine"]), value)
            for kind, name, doc, value in VLLM_ENGINE_FAMILIES
        ]
        for w in alive:
            if w.load is not None:
                key = [self.model_name, w.role, w.worker_id]
                for family, value in families:
                    family.add_metric(key, value(w.load))
        yield from (family for family, _ in families)


def register_workers(core, model_name: str = "") -> WorkerCollector:
    collector = WorkerCollector(core, model_name)
    REGISTRY.register(collector)
    return collector


def observe_request(
    state, status: str, model_name: str = "", role: str = "decode"
) -> tuple[float | None, float | None]:
    """Count a finished request (a RequestState) by status and observe its latencies, under
    pdserve's names and vLLM's (`role`: its decode worker's); its (TTFT, TPOT) when it had a
    first token (and a second)."""
    REQUESTS.labels(status).inc()
    ttft = tpot = None
    now = time.monotonic()
    vllm = (model_name, role)
    if state.first_token_at:
        ttft = state.first_token_at - state.created
        TTFT.observe(ttft)
        VLLM_TTFT.labels(*vllm).observe(ttft)
        TTFT_BY_CACHE.labels("warm" if state.warm else "cold").observe(ttft)
        n = len(state.tokens)
        if n > 1:
            tpot = (state.last_token_at - state.first_token_at) / (n - 1)
            ITL.observe(tpot)
            itl = VLLM_ITL.labels(*vllm)
            for gap in state.gaps:
                itl.observe(gap)
    E2E.observe(now - state.created)
    VLLM_E2E.labels(*vllm).observe(now - state.created)
    prefilled_by = "prefill" if state.prefill_id else role
    VLLM_PROMPT_TOKENS.labels(model_name, prefilled_by).inc(len(state.prompt))
    VLLM_GENERATION_TOKENS.labels(*vllm).inc(len(state.tokens))
    if status == "ok":
        VLLM_SUCCESS.labels(*vllm, state.finish_reason or "stop").inc()
    return ttft, tpot


def failure_cause(error: str | None) -> str:
    """The cause (one of KV_FAILURE_CAUSES) of a failed push, from its error message."""
    text = (error or "").lower()
    if "timed out" in text:
        return "timeout"
    if "layout" in text:
        return "layout_refused"
    if "staging" in text:
        return "staging_full"
    return "transport"


def observe_prefill_done(msg, encoding: str, placed_at: float | None) -> None:
    """A prefill worker's PrefillDone: its KV push (bytes by wire `encoding`, seconds, what the
    forward pass did not hide), how long D's blocks waited since `placed_at`, and a failure."""
    KV_BYTES.labels(encoding).inc(msg.transfer_bytes)
    KV_SECONDS.inc(msg.transfer_s)
    if msg.transfer_bytes:
        KV_REQUEST_BYTES.observe(msg.transfer_bytes)
        KV_REQUEST_SECONDS.observe(msg.transfer_s)
        if msg.transfer_s > 0:
            KV_REQUEST_GBPS.observe(msg.transfer_bytes / msg.transfer_s / 1e9)
    KV_EXPOSED.observe(msg.exposed_s)
    if placed_at is not None:  # D's blocks waited under lease this long
        DECODE_KV_WAIT.observe(time.monotonic() - placed_at)
    REMOTE_PREFILL.observe(msg.prefill_s)
    if msg.first_token is None:
        KV_FAILURES.inc()
        KV_FAILURES_BY_CAUSE.labels(failure_cause(msg.error)).inc()
