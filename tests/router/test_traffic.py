"""What the autoscaler observes of the traffic (`router/traffic.py`)."""

from __future__ import annotations

from pdserve.router.traffic import UNKNOWN_OUTPUT, Traffic


def test_window_has_arrivals_with_their_lengths_and_the_latencies_clients_saw():
    t = Traffic(history_s=100)
    a = t.arrived(300, 64, now=0.0)
    t.arrived(500, 1000, now=1.0)  # refused, or still running: its output is estimated
    w = t.window(10, now=2.0)
    assert w.lengths == [(300, 64), (500, UNKNOWN_OUTPUT)]  # nothing finished yet
    assert w.ttft_p90 is None and w.tpot_p90 is None
    t.finished(a, ttft=0.5, tpot=0.02, output=40, now=3.0)
    w = t.window(10, now=3.0)
    assert w.lengths == [(300, 40), (500, 40)]  # its own; the median of finished ones
    assert w.ttft_p90 == 0.5 and w.tpot_p90 == 0.02
    t.arrived(100, 8, now=4.0)
    assert t.window(10, now=4.0).lengths[-1] == (100, 8)  # at most its max_tokens


def test_window_and_history_slide():
    t = Traffic(history_s=30)
    for i in range(10):
        t.finished(t.arrived(100, 10, now=float(i)), ttft=float(i), tpot=None, output=10,
                   now=float(i))  # fmt: skip
    w = t.window(3, now=9.5)
    assert len(w.lengths) == 3 and w.tpot_p90 is None  # arrivals at 7, 8, 9
    assert 8.0 < w.ttft_p90 <= 9.0
    t.arrived(100, 10, now=100.0)
    assert len(t.arrivals) == 1 and not t.first_tokens and not t.finishes  # older than 30 s
