"""kill -9 a decode worker mid-stream: its request migrates to the other decode worker and the
client's stream goes on with exactly the tokens an uninterrupted run gives (greedy, float32);
the restarted worker re-registers and takes traffic again; no block leaks anywhere. With
tracing on (pdserve[otel]), the migrated request's one trace holds both decode workers' spans
and the router's migration event. Moved to a worker that speculates (prompt lookup), the
replayed request's proposals are accepted and the client's text is still the plain run's."""

from __future__ import annotations

import secrets
import signal
import threading

import pytest
from otlp_receiver import attrs

from .cluster import complete, metric, stream, wait_until

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


def decode_spans(receiver, trace_id: bytes, wid: str) -> dict:
    """Name -> span of the decode-side spans `wid` sent for one trace."""
    return {g.span.name: g.span for g in receiver.trace(trace_id)
            if g.worker == wid and g.span.name.startswith("decode.")}  # fmt: skip


def test_decode_worker_killed_mid_stream_migrates(cluster, receiver):
    cluster.ensure_all()
    want = baselines(cluster.url)
    migrations = metric(cluster.url, "pdserve_migrations_total")
    cluster.wait_decoders_idle()  # the baselines' load reports must not name the victim
    victim, other = [], {}
    trace_id = secrets.token_bytes(16)
    header = {"traceparent": f"00-{trace_id.hex()}-{secrets.token_hex(8)}-01"}

    def run_other():
        other["out"] = stream(cluster.url, {"prompt": PROMPTS[1], **GREEDY})

    def on_chunk(n: int) -> None:
        if n == 3:  # A is the only running request: its worker is the busy one
            victim.append(cluster.busy_decode_worker())
            other["thread"] = threading.Thread(target=run_other)
            other["thread"].start()  # B lands on the other decode worker (fewer in flight)
        if n == 8:
            if receiver is not None:  # sent within 100 ms of its first token: long ago
                wait_until(lambda: "decode.first_token" in decode_spans(receiver, trace_id,
                           victim[0]), 5, "the victim's first-token span")  # fmt: skip
            cluster.kill(victim[0])

    out = stream(cluster.url, {"prompt": PROMPTS[0], **GREEDY}, on_chunk=on_chunk, headers=header)
    other["thread"].join(60)
    assert (out.kind, out.completion_tokens) == ("ok", N), out
    assert out.text == want[PROMPTS[0]]  # no duplicated or missing token after the migration
    assert (other["out"].kind, other["out"].text) == ("ok", want[PROMPTS[1]])
    assert metric(cluster.url, "pdserve_migrations_total") == migrations + 1
    assert victim[0] not in cluster.health()
    cluster.assert_clean()
    if receiver is not None:
        assert_trace_shows_both_decode_workers(receiver, trace_id, victim[0])


def test_decode_worker_stopped_with_ctrl_c_mid_stream_leaves_at_once(cluster):
    """SIGINT (Ctrl-C on a `pdserve worker`) stops it at once, and it tells the router so
    (`Leaving`): its stream moves to the other decode worker then, not once its heartbeat has
    lapsed, and no worker failure is counted; the client's text is the uninterrupted run's."""
    cluster.ensure_all()
    want = complete(cluster.url, {"prompt": PROMPTS[0], **GREEDY})
    assert (want.kind, want.completion_tokens) == ("ok", N), want
    failures = metric(cluster.url, "pdserve_worker_failures_total")
    migrations = metric(cluster.url, "pdserve_migrations_total")
    cluster.wait_decoders_idle()
    victim = []

    def on_chunk(n: int) -> None:
        if n == 3:
            victim.append(cluster.busy_decode_worker())
        if n == 8:
            cluster.signal(victim[0], signal.SIGINT)

    out = stream(cluster.url, {"prompt": PROMPTS[0], **GREEDY}, on_chunk=on_chunk)
    assert (out.kind, out.completion_tokens, out.text) == ("ok", N, want.text), out
    assert metric(cluster.url, "pdserve_migrations_total") == migrations + 1
    assert metric(cluster.url, "pdserve_worker_failures_total") == failures  # left, not lost
    cluster.wait_gone(victim[0])
    cluster.assert_clean()


def assert_trace_shows_both_decode_workers(receiver, trace_id: bytes, victim: str) -> None:
    """The migrated request's trace: the router's request span with one migration event from
    the victim to a survivor, and decode spans under it from both workers' processes."""
    spans = wait_until(
        lambda: (found := receiver.trace(trace_id)) and any(
            g.span.name == "request" for g in found) and any(
            g.span.name == "decode.decode" and g.worker != victim for g in found) and found,
        30, "the migrated request's request span and the survivor's decode span",
        state=lambda: sorted((g.worker, g.span.name) for g in receiver.trace(trace_id)),
    )  # fmt: skip
    (request,) = [g.span for g in spans if g.span.name == "request"]
    assert attrs(request)["migrations"] == 1
    (moved,) = [e for e in request.events if e.name == "migration"]
    survivor = attrs(moved)["to_worker"]
    assert attrs(moved)["from_worker"] == victim and survivor not in ("", victim), attrs(moved)
    workers = {g.worker for g in spans if g.span.name.startswith("decode.")}
    assert workers == {victim, survivor}, workers  # two worker processes, one trace
    before, after = (
        decode_spans(receiver, trace_id, victim),
        decode_spans(receiver, trace_id, survivor),
    )
    assert "decode.first_token" in before and "decode.decode" not in before  # it died decoding
    assert after.keys() >= {"decode.first_token", "decode.decode"}, after.keys()
    # the replay on the survivor skipped the tokens the client had: the migration's count
    assert attrs(after["decode.first_token"])["migrated_after"] == attrs(moved)["tokens_streamed"]
    for span in [*before.values(), *after.values()]:
        assert span.parent_span_id == request.span_id, span.name
    assert moved.time_unix_nano >= before["decode.first_token"].end_time_unix_nano
    assert moved.time_unix_nano <= after["decode.first_token"].start_time_unix_nano + 2_000_000


COUNT = "one two three four five six seven eight nine ten"
# Over one block: the baseline leaves its first block cached on its worker, which placement
# then prefers for the same prompt; prompt lookup finds the count it goes on copying.
REPEAT = f"{COUNT}, {COUNT}, one two"
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'
# Long enough that the victim is still decoding when the client kills it at its 8th chunk: with
# N tokens a fast worker could finish the whole answer while the client (on a loaded machine)
# was still asking /health which worker was busy, and the speculating one then got nothing.
SPEC_GREEDY = {**GREEDY, "max_tokens": 160}


def test_a_request_migrated_to_a_speculating_worker_keeps_the_plain_greedy_text(cluster):
    decoders = [w for w in cluster.argv if w.startswith("decode")]
    # the one the test before left down, if any: starting it with speculation costs no more
    speculating = next((w for w in decoders if w not in cluster.pids()), decoders[0])
    (plain,) = [w for w in decoders if w != speculating]
    cluster.ensure_all(down=(speculating,))
    want = complete(cluster.url, {"prompt": REPEAT, **SPEC_GREEDY})  # on `plain`: cached there
    assert (want.kind, want.completion_tokens) == ("ok", SPEC_GREEDY["max_tokens"]), want
    cluster.restart(speculating, extra=("--speculative-config", SPEC))
    try:
        victim = []

        def on_chunk(n: int) -> None:
            if n == 3:
                victim.append(cluster.busy_decode_worker())
            if n == 8 and victim == [plain]:  # placed where its first block is cached
                cluster.kill(plain)

        migrations = metric(cluster.url, "pdserve_migrations_total")
        out = stream(cluster.url, {"prompt": REPEAT, **SPEC_GREEDY}, on_chunk=on_chunk)
        assert victim == [plain], (victim, plain)
        assert (out.kind, out.completion_tokens) == ("ok", SPEC_GREEDY["max_tokens"]), out
        assert out.text == want.text, out
        assert metric(cluster.url, "pdserve_migrations_total") == migrations + 1
        workers = cluster.assert_clean()  # their reports since the stream ended
        assert workers[speculating]["spec_accepted_tokens"] > 0, workers[speculating]
    finally:
        cluster.restart(speculating)  # as the server started it, for the tests after this one


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
