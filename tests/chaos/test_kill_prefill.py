"""kill -9 the prefill worker while it prefills: the router declares it dead, the decode worker
prefills those prompts itself, and every request completes with the greedy output of an
undisturbed run (or, at worst, a clear error) within its deadline; the restarted prefill worker
takes traffic again; no block leaks."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .cluster import complete, metric
from .conftest import HEARTBEAT_TIMEOUT_S

pytestmark = pytest.mark.slow
N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
DEADLINE_S = 60.0


def long_prompt(topic: str) -> str:
    """~300 tokens, different from the first block on, so no prefix cache shortens it."""
    return f"{topic}. " + " ".join(
        f"Item {i}: the {topic.lower()} log shows {i * 7 % 31} events in hour {i % 24}."
        for i in range(24)
    )


PROMPTS = [long_prompt(t) for t in ("Weather", "Traffic", "Harbour")]


def prefill_started(cluster, timeout_s: float = 5.0) -> None:
    """Wait until the prefill worker reports queued or running prompt tokens (or timeout:
    then the kill still lands while the Prefill messages are in flight)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = cluster.health().get("prefill-0", {})
        if load.get("queued_tokens") or load.get("running"):
            return
        time.sleep(0.05)


def test_prefill_worker_killed_mid_prefill(cluster):
    cluster.ensure_all()
    failures = metric(cluster.url, "pdserve_worker_failures_total")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [
            pool.submit(complete, cluster.url, {"prompt": p, **GREEDY}, DEADLINE_S) for p in PROMPTS
        ]
        prefill_started(cluster)
        cluster.kill("prefill-0")
        outs = [f.result() for f in futures]
    assert [o.kind for o in outs] == ["ok"] * len(PROMPTS), outs
    # At least one request waited for the failure detector: it was held by the dead worker.
    assert HEARTBEAT_TIMEOUT_S < max(o.seconds for o in outs) < DEADLINE_S, outs
    cluster.wait_gone("prefill-0")
    assert metric(cluster.url, "pdserve_worker_failures_total") == failures + 1
    cluster.assert_clean()
    # The same prompts through a healthy prefill pool give the same tokens.
    cluster.restart("prefill-0")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        again = list(pool.map(lambda p: complete(cluster.url, {"prompt": p, **GREEDY}), PROMPTS))
    assert [(o.kind, o.text) for o in again] == [("ok", o.text) for o in outs]
    assert [o.completion_tokens for o in outs] == [N] * len(PROMPTS)


def test_restarted_prefill_worker_takes_traffic(cluster):
    cluster.ensure_all()
    remote = metric(cluster.url, 'pdserve_prefill_decisions_total{where="remote"}')
    kv_bytes = metric(cluster.url, "pdserve_kv_transfer_bytes_total")
    out = complete(cluster.url, {"prompt": long_prompt("Orchard")[:200], **GREEDY})
    assert (out.kind, out.completion_tokens) == ("ok", N)
    assert metric(cluster.url, 'pdserve_prefill_decisions_total{where="remote"}') == remote + 1
    assert metric(cluster.url, "pdserve_kv_transfer_bytes_total") > kv_bytes  # pushed by P
    cluster.assert_clean()
