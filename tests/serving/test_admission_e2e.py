"""SLO-aware admission against the real server: a burst beyond what the SLO allows gets 429
with Retry-After (through the real `openai` client), admitted requests complete, nothing leaks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from servers import Server, metric_sum
from waiting import wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
SLO_TTFT = 1.0


def prompt(i: int) -> str:  # ~400 tokens, different per request (no prefix-cache hits)
    return f"Request {i}. " + " ".join(
        f"Item {j}: crate {i * 31 + j} left dock {j % 5} at hour {(i + j) % 24}." for j in range(30)
    )


@pytest.fixture(scope="module")
def server():
    with Server("--mode", "colocated", "--slo-ttft", str(SLO_TTFT), "--kv-cache-gb", "0.25") as s:
        yield s


def complete(server, i: int):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        r = c.completions.create(model=MODEL, prompt=prompt(i), max_tokens=4, temperature=0)
        return "ok", r.usage.completion_tokens
    except openai.RateLimitError as exc:
        return "429", (exc.response.headers.get("retry-after"), exc.body, exc.message)


def test_burst_over_the_ttft_slo_gets_429_with_retry_after(server):
    assert complete(server, 0)[0] == "ok"  # the worker measures its prefill speed
    wait_until(  # ... and reports it in a heartbeat: admission estimates TTFT with it
        lambda: any(w.get("prefill_tok_s", 0) > 0 for w in server.health()["workers"].values()),
        10,
        "a worker to report its prefill speed",
        state=server.health,
    )
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda i: complete(server, i), range(1, 13)))
    ok = [r for kind, r in results if kind == "ok"]
    refused = [r for kind, r in results if kind == "429"]
    assert ok and refused, results  # the first is admitted; 12 x ~400 tokens cannot fit 1 s
    assert all(tokens == 4 for tokens in ok)
    for retry_after, body, message in refused:
        assert retry_after is not None and int(retry_after) >= 1
        assert body["code"] == "overloaded"
        assert "too close to the 1 s SLO" in message
    metrics = httpx.get(server.url + "/metrics").text
    assert 'pdserve_rejected_total{reason="slo_ttft"}' in metrics
    workers = server.wait_idle_and_clean()  # every block free
    assert all(w["prefill_tok_s"] > 0 for w in workers.values())
    wait_until(  # the router has forgotten every admitted request: nothing queued for prefill
        lambda: metric_sum(server.url, "pdserve_requests_total") == 1 + len(ok),
        10,
        "the router to finish every admitted request",
    )
    assert complete(server, 99)[0] == "ok"  # once the burst has drained, admitted again
