"""kill -9 a decode worker mid-stream: its request migrates to the other decode worker and the
client's stream goes on with exactly the tokens an uninterrupted run gives (greedy, float32);
the restarted worker re-registers and takes traffic again; no block leaks anywhere."""

from __future__ import annotations

import threading

import pytest

from .cluster import complete, metric, stream

pytestmark = pytest.mark.slow
# Shorter than one block (16 tokens): no prefix overlap steers placement, so the router's
# tie-break (fewest requests in flight) puts two concurrent requests on different workers.
PROMPTS = ("The capital of France is", "def add(a, b):")
N = 40  # long enough that the load report shows the stream running before it ends
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}


def baselines(url: str) -> dict[str, str]:
    want = {}
    for prompt in PROMPTS:
        out = complete(url, {"prompt": prompt, **GREEDY})
        assert (out.kind, out.completion_tokens) == ("ok", N), out
        want[prompt] = out.text
    return want


def test_decode_worker_killed_mid_stream_migrates(cluster):
    cluster.ensure_all()
    want = baselines(cluster.url)
    migrations = metric(cluster.url, "pdserve_migrations_total")
    cluster.wait_decoders_idle()  # the baselines' load reports must not name the victim
    victim, other = [], {}

    def run_other():
        other["out"] = stream(cluster.url, {"prompt": PROMPTS[1], **GREEDY})

    def on_chunk(n: int) -> None:
        if n == 3:  # A is the only running request: its worker is the busy one
            victim.append(cluster.busy_decode_worker())
            other["thread"] = threading.Thread(target=run_other)
            other["thread"].start()  # B lands on the other decode worker (fewer in flight)
        if n == 8:
            cluster.kill(victim[0])

    out = stream(cluster.url, {"prompt": PROMPTS[0], **GREEDY}, on_chunk=on_chunk)
    other["thread"].join(60)
    assert (out.kind, out.completion_tokens) == ("ok", N), out
    assert out.text == want[PROMPTS[0]]  # no duplicated or missing token after the migration
    assert (other["out"].kind, other["out"].text) == ("ok", want[PROMPTS[1]])
    assert metric(cluster.url, "pdserve_migrations_total") == migrations + 1
    assert victim[0] not in cluster.health()
    cluster.assert_clean()


def test_restarted_decode_worker_takes_traffic(cluster):
    cluster.ensure_all()  # restarts the worker the previous test killed
    before = {w: h["prefix_query_tokens"] for w, h in cluster.health().items()}
    threads = [
        threading.Thread(target=complete, args=(cluster.url, {"prompt": p, **GREEDY}))
        for p in PROMPTS
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    cluster.assert_clean()
    after = {w: h["prefix_query_tokens"] for w, h in cluster.health().items()}
    served = sorted(w for w in after if after[w] > before[w] and not w.startswith("prefill"))
    assert served == ["decode-1", "decode-2"]
