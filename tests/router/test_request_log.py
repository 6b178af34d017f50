"""The request log's timeline of a request (router/request_log.py) and the bench's TTFT
breakdown from such lines (bench/timeline.py)."""

from __future__ import annotations

import json

from pdserve.bench import timeline
from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams
from pdserve.router.request_log import RequestLog, phases
from pdserve.router.state import RequestState


def remote_state(t0: float = 100.0, **done) -> RequestState:
    s = RequestState("r-1", [1, 2, 3], SamplingParams(max_tokens=4), True, "decode-1")
    s.arrived_at, s.created, s.placed_at = t0, t0 + 0.01, t0 + 0.02
    report = dict(
        first_token=7, queue_s=0.03, exposed_s=0.005, transfer_bytes=4096, transfer_s=0.02
    )
    s.prefill_report = m.PrefillDone("r-1", **{**report, **done})
    s.prefill_done_at = s.first_token_at = t0 + 0.2
    s.last_token_at, s.prefill_id, s.tokens = t0 + 0.5, "prefill-0", [7, 8, 9, 10]
    return s


def test_remote_phases_follow_each_other_to_the_first_token():
    got = phases(remote_state())
    assert [p[0] for p in got] == [
        "queue", "decode_wait", "prefill_queue", "prefill", "transfer", "decode",
    ]  # fmt: skip
    for (_, _, end), (_, start, _) in zip(got, got[1:], strict=False):
        assert end == start
    spans = {name: round(b - a, 6) for name, a, b in got}
    assert spans == {"queue": 0.01, "decode_wait": 0.01, "prefill_queue": 0.03,
                     "prefill": 0.145, "transfer": 0.005, "decode": 0.3}  # fmt: skip


def test_a_worker_duration_never_crosses_the_routers_events():
    # a prefill worker reporting more queue than the router saw between its messages
    got = dict((n, (a, b)) for n, a, b in phases(remote_state(queue_s=5.0)))
    assert got["prefill_queue"][1] == got["transfer"][1] - 0.005  # clamped, still ordered
    assert got["prefill"][0] == got["prefill"][1]


def test_failed_prefill_ends_with_local_prefill(tmp_path):
    s = remote_state(first_token=None)
    s.first_token_at = s.prefill_done_at + 0.1
    assert [p[0] for p in phases(s)][-2:] == ["local_prefill", "decode"]
    log = RequestLog(tmp_path / "r.jsonl")
    log.write(s, "ok")
    log.close()
    (rec,) = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert rec["fallback"] and rec["remote"] and rec["kv_bytes"] == 4096
    assert abs(rec["ttft_s"] - 0.3) < 1e-9 and rec["phases"][0] == ["queue", 0.0, 0.01]


def test_breakdown_per_percentile():
    recs = [
        {"status": "ok", "ttft_s": 0.1 * (i + 1),
         "phases": [["queue", 0, 0.01 * i], ["prefill", 0.01 * i, 0.1 * (i + 1)]]}
        for i in range(100)
    ] + [{"status": "error", "ttft_s": None, "phases": []}]  # fmt: skip
    rows = timeline.breakdown(recs)
    assert [r["percentile"] for r in rows] == [50, 90, 99]
    p50 = rows[0]
    assert abs(p50["ttft_s"] - 5.1) < 1e-9 and p50["requests"] == 10
    assert (
        abs(p50["queue"] + p50["prefill"] - sum(0.1 * (i + 1) for i in range(45, 55)) / 10) < 1e-9
    )
    assert p50["transfer"] == 0 and p50["decode_wait"] == 0
    assert timeline.breakdown([]) == [] and timeline.markdown([], 0) == []
