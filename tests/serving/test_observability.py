"""Observability of a disaggregated request against one real `pdserve serve` (router, a
prefill and a decode worker) with tracing on and a request log: vLLM's metric names beside
pdserve's, the per-request KV transfer histograms and failure causes, the request log of a
short bench run, and one trace across the three processes, received by an OTLP/HTTP receiver
in this test."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from servers import Server, free_port, metric_samples, metric_sum
from waiting import wait_until

pytestmark = pytest.mark.slow
pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="tracing needs pdserve[otel] (opentelemetry-sdk, opentelemetry-exporter-otlp)",
)
from otlp_receiver import Receiver  # noqa: E402  (needs the protobufs checked above)

FLAGS = ("--mode", "disagg", "--local-prefill-threshold", "0", "--kv-cache-gb", "0.25")


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def request_log(tmp_path_factory):
    return tmp_path_factory.mktemp("obs") / "requests.jsonl"


@pytest.fixture(scope="module")
def server(receiver, request_log):
    env = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # ms between the span exporters' batches
    flags = (*FLAGS, "--otlp-traces-endpoint", receiver.url, "--request-log", str(request_log))
    with Server(*flags, env=env) as s:
        yield s


def complete(url: str, prompt: str, max_tokens: int = 8, headers=None) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_vllm_metric_names_beside_pdserve_names(server):
    name = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    before = metric_sum(server.url, "vllm:generation_tokens_total")
    out = complete(server.url, "The observability of a request begins with", max_tokens=6)
    used = out["usage"]
    server.wait_idle_and_clean()
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for family in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket", "pdserve_ttft_seconds_bucket",
    ):  # fmt: skip
        assert f"\n{family}" in text, family
    # labelled with the model's name and the role of the worker that did the work
    gen = metric_samples(server.url, "vllm:generation_tokens_total")
    assert gen[(name, "decode")] - before == used["completion_tokens"]
    prompt = metric_samples(server.url, "vllm:prompt_tokens_total")
    assert prompt[(name, "prefill")] >= used["prompt_tokens"]  # prefilled by the prefill pool
    running = metric_samples(server.url, "vllm:num_requests_running")  # (engine, model, role)
    assert {labels[1:] for labels in running} == {(name, "prefill"), (name, "decode")}
    # idle once a heartbeat taken after the request's end came (/health may show an older one)
    wait_until(
        lambda: not any(metric_samples(server.url, "vllm:num_requests_running").values()),
        10, "vllm:num_requests_running 0 everywhere",
        state=lambda: metric_samples(server.url, "vllm:num_requests_running"),
    )  # fmt: skip
    usage = metric_samples(server.url, "vllm:kv_cache_usage_perc")
    assert all(0 <= v <= 1 for v in usage.values()) and len(usage) == 2
    # one ITL observation per gap between two tokens: n - 1 for this request
    itl = metric_samples(server.url, "vllm:inter_token_latency_seconds_count")
    assert itl[(name, "decode")] >= used["completion_tokens"] - 1


def test_kv_transfer_histograms_per_request_and_failure_causes(server):
    n0 = metric_sum(server.url, "pdserve_kv_transfer_request_bytes_count")
    complete(server.url, "A request whose KV moves from the prefill worker to the decoder")
    assert metric_sum(server.url, "pdserve_kv_transfer_request_bytes_count") == n0 + 1
    assert metric_sum(server.url, "pdserve_kv_transfer_request_bytes_sum") > 0
    assert metric_sum(server.url, "pdserve_kv_transfer_request_seconds_count") == n0 + 1
    assert metric_sum(server.url, "pdserve_kv_transfer_request_gbps_count") == n0 + 1
    causes = metric_samples(server.url, "pdserve_kv_transfer_failures_by_cause_total")
    assert {c for (c,) in causes} == {
        "transport", "timeout", "lease_expired", "layout_refused", "staging_full",
    }  # fmt: skip
    assert all(v == 0 for v in causes.values())  # nothing failed here


def test_request_log_of_a_short_bench_run(server, request_log, tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "pdserve.cli", "bench", "--url", server.url + "/v1",
        "--prompt-tokens", "uniform:20,60", "--output-tokens", "4", "--num-requests", "4",
        "--concurrency", "2", "--out", str(out), "--no-progress", "--timeout", "120",
        "--request-log", str(request_log),
    ]  # fmt: skip
    before = request_log.read_text().count("\n") if request_log.exists() else 0
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(x) for x in request_log.read_text().splitlines()[before:]]
    assert len(records) == 4 and all(r["status"] == "ok" for r in records), records
    for r in records:
        names = [p[0] for p in r["phases"]]
        assert names == ["queue", "decode_wait", "prefill_queue", "prefill", "transfer", "decode"]
        bounds = [t for _, a, b in r["phases"] for t in (a, b)]
        assert bounds == sorted(bounds) and bounds[0] == 0  # ordered, each where the last ended
        transfer_end = r["phases"][4][2]
        assert abs(transfer_end - r["ttft_s"]) < 0.005  # the first token came with the KV
        assert r["prefill_worker"].startswith("prefill") and r["kv_bytes"] > 0
        assert r["output_tokens"] == 4 and r["remote"] and not r["fallback"]
    summary = (out / "summary.md").read_text()
    assert "TTFT breakdown" in summary and "| p50 |" in summary
    results = json.loads((out / "results.json").read_text())
    rows = results["config"]["ttft_breakdown"]
    assert [row["percentile"] for row in rows] == [50, 90, 99]
    assert (out / "ttft_breakdown.png").exists()


def by_name(spans) -> dict[str, tuple[str, object]]:
    return {g.span.name: (g.service, g.span) for g in spans}


def test_one_trace_across_router_prefill_and_decode(server, receiver):
    trace_id, caller = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    header = {"traceparent": f"00-{trace_id}-{caller}-01"}
    out = complete(server.url, "Follow this request through its three processes", 6, header)
    assert out["usage"]["completion_tokens"] == 6
    want = {
        "request": "pdserve-router", "placement": "pdserve-router",
        "prefill.queue": "pdserve-prefill", "prefill.compute": "pdserve-prefill",
        "prefill.kv_push": "pdserve-prefill", "decode.kv_wait": "pdserve-decode",
        "decode.first_token": "pdserve-decode", "decode.decode": "pdserve-decode",
    }  # fmt: skip
    tid = bytes.fromhex(trace_id)
    spans = wait_until(
        lambda: (found := by_name(receiver.trace(tid))).keys() >= want.keys() and found,
        30, "every span of the request", state=lambda: sorted(by_name(receiver.trace(tid))),
    )  # fmt: skip
    assert {name: spans[name][0] for name in want} == want  # three processes
    request = spans["request"][1]
    assert request.parent_span_id == bytes.fromhex(caller)  # under the caller's span
    for name in want.keys() - {"request"}:
        assert spans[name][1].parent_span_id == request.span_id, name
    attrs = {a.key: a.value for a in request.attributes}
    assert attrs["pdserve.output_tokens"].int_value == 6
    assert "pdserve.prompt" not in attrs and "pdserve.text" not in attrs  # never the text
    # the phases follow one another inside the request; the push streams layers while the
    # last chunk computes (it starts inside compute) and ends before decoding starts
    order = ["placement", "prefill.queue", "prefill.compute", "prefill.kv_push",
             "decode.first_token", "decode.decode"]  # fmt: skip
    times = {n: (spans[n][1].start_time_unix_nano, spans[n][1].end_time_unix_nano) for n in order}
    slack = 2_000_000  # 2 ms: the clocks of two processes
    for a, b in zip(order, order[1:], strict=False):
        if b == "prefill.kv_push":
            assert times[a][0] <= times[b][0] <= times[a][1] + slack, times
        else:
            assert times[a][1] <= times[b][0] + slack, (a, b, times)
    assert request.start_time_unix_nano <= times["placement"][0]
    assert times["decode.decode"][1] <= request.end_time_unix_nano + slack
    assert_phases_add_up_to_the_ttft(request, {n: s for n, (_, s) in spans.items()})
    push = {a.key: a.value for a in spans["prefill.kv_push"][1].attributes}
    assert push["pdserve.bytes"].int_value > 0 and push["pdserve.ok"].bool_value


def assert_phases_add_up_to_the_ttft(request, spans: dict) -> None:
    """The trace's phases of a remote prefill, up to the router's `first_token` event (on its
    clock: the client's TTFT), follow one another without overlapping and add up to that
    TTFT: admission (router), placement, decode_wait (the decode worker reserving blocks: the
    messages between placement and the prefill worker), prefill.queue, prefill.compute and the
    push's exposed part. What no span covers is the last message, PrefillDone to the router."""
    (first,) = [e.time_unix_nano for e in request.events if e.name == "first_token"]
    cuts = [request.start_time_unix_nano]  # each phase ends where the next starts
    for name in ("placement", "prefill.queue", "prefill.compute"):
        cuts += [spans[name].start_time_unix_nano, spans[name].end_time_unix_nano]
    cuts.append(max(cuts[-1], spans["prefill.kv_push"].end_time_unix_nano))  # exposed push
    durations = [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
    slack = 2_000_000  # 2 ms: the clocks of three processes
    assert min(durations) >= -slack, (durations, cuts)  # no phase overlaps the one before
    ttft = first - request.start_time_unix_nano
    hop = ttft - sum(durations)  # PrefillDone's way to the router (~1 ms on an idle machine)
    # a few ms; the bound allows a loaded 2-core machine's scheduling delays
    assert -slack <= hop <= 25_000_000, (hop, durations, ttft)


def test_bad_traceparent_is_ignored_not_refused(server, receiver):
    out = complete(server.url, "A malformed trace header", 2, {"traceparent": "00-nonsense-xx"})
    assert out["usage"]["completion_tokens"] == 2
    rid_spans = wait_until(
        lambda: [g.span for g in list(receiver.spans) if g.span.name == "request"
                 and any(a.value.int_value == 2 and a.key == "pdserve.max_tokens"
                         for a in g.span.attributes)],
        30, "the request span of the request with a bad traceparent",
    )  # fmt: skip
    assert rid_spans[-1].parent_span_id == b""  # a trace of its own


DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "pdserve-pd-overview.json"
NEEDS_AUTOSCALE = {"pdserve_autoscale_target_workers"}  # set only by `serve --autoscale`


@pytest.fixture
def prometheus(server, tmp_path):
    """A real Prometheus (Debian's `prometheus` package) scraping the server every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary: `apt-get install prometheus` (docs/observability.md)")
    port = free_port()
    target = server.url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: pdserve, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    argv = [
        binary,
        f"--config.file={tmp_path / 'prometheus.yml'}",
        "--log.level=warn",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    api = f"http://127.0.0.1:{port}/api/v1/query"

    def query(expr: str) -> list:
        try:
            body = httpx.get(api, params={"query": expr}, timeout=5).json()
        except (httpx.TransportError, ValueError):  # not up, or not ready ("Service Unavailable")
            return []
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    try:
        wait_until(lambda: query('up{job="pdserve"} == 1'), 30, "Prometheus scraping pdserve")
        yield query
    finally:
        proc.terminate()
        proc.wait(10)


def test_every_dashboard_panel_has_data_in_a_real_prometheus(server, prometheus):
    for i in range(3):  # a short load, scraped before and after
        complete(server.url, f"Dashboards chart what Prometheus scraped, request {i}", 4)
    wait_until(lambda: prometheus("increase(pdserve_requests_total[1m]) > 0"), 30,
               "Prometheus to see the requests")  # fmt: skip
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [(p["title"], t["expr"]) for p in panels for t in p["targets"]]
    assert len(panels) >= 10
    empty = [
        (title, expr) for title, expr in exprs
        if not any(n in expr for n in NEEDS_AUTOSCALE) and not prometheus(expr)
    ]  # fmt: skip
    assert not empty, empty
