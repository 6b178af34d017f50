"""kill -9 the prefill worker while it prefills: the router declares it dead, the decode worker
prefills those prompts itself, and every request completes with the greedy output of an
undisturbed run (or, at worst, a clear error) within its deadline; the restarted prefill worker
takes traffic again; no block leaks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from servers import metric_sum
from waiting import wait_until

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


def placed(cluster) -> float:
    """Requests the router has placed so far (each decides where its prompt is prefilled)."""
    return metric_sum(cluster.url, "pdserve_prefill_decisions_total")


def wait_placed(cluster, before: float, n: int, timeout_s: float = 30.0) -> None:
    """Wait until the router has placed `n` more requests: from then on their Prefill
    messages are on their way to the prefill worker, or it holds them already. (Its load
    reports lag by ~0.5 s, so waiting for them to show the prompts could miss the prefill.)"""
    wait_until(
        lambda: placed(cluster) >= before + n,
        timeout_s,
        f"the router to place {n} requests",
        interval_s=0.02,
        state=lambda: placed(cluster) - before,
    )


def test_prefill_worker_killed_mid_prefill(cluster):
    cluster.ensure_all()
    failures = metric(cluster.url, "pdserve_worker_failures_total")
    before = placed(cluster)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [
            pool.submit(complete, cluster.url, {"prompt": p, **GREEDY}, DEADLINE_S) for p in PROMPTS
        ]
        wait_placed(cluster, before, len(PROMPTS))
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
    kv_bytes = metric_sum(cluster.url, "pdserve_kv_transfer_bytes_total")  # (by encoding)
    out = complete(cluster.url, {"prompt": long_prompt("Orchard")[:200], **GREEDY})
    assert (out.kind, out.completion_tokens) == ("ok", N)
    assert metric(cluster.url, 'pdserve_prefill_decisions_total{where="remote"}') == remote + 1
    assert metric_sum(cluster.url, "pdserve_kv_transfer_bytes_total") > kv_bytes  # pushed by P
    cluster.assert_clean()
