import msgspec
import pytest

from pdserve.bench.metrics import SLO, RequestRecord, goodput, summarize, summarize_by_class, tpot


def make_record(index=0, klass="chat", status="ok", ttft=0.1, itl=(0.02, 0.04), **kw):
    out = len(itl) + 1 if status == "ok" else 0
    e2e = ttft + sum(itl) if status == "ok" else None
    fields = dict(
        index=index,
        klass=klass,
        status=status,
        error=None if status == "ok" else "boom",
        arrival_s=0.0,
        start_s=0.0,
        ttft_s=ttft if status == "ok" else None,
        itl_s=list(itl) if status == "ok" else [],
        tpot_s=tpot(ttft, e2e, out),
        e2e_s=e2e,
        prompt_tokens=10,
        output_tokens=out,
    )
    fields.update(kw)
    return RequestRecord(**fields)


def test_tpot_definition():
    assert tpot(0.1, 0.4, 4) == pytest.approx(0.1)
    assert tpot(0.1, 0.1, 1) is None
    assert tpot(None, 0.4, 4) is None


def test_slo_meets_each_target():
    slo = SLO(ttft_s=0.2, tpot_s=0.05, itl_p99_s=0.045)
    assert slo.meets(make_record())
    assert not slo.meets(make_record(ttft=0.25))
    assert not slo.meets(make_record(itl=(0.06, 0.06)))  # tpot 0.06
    assert not slo.meets(make_record(itl=(0.01, 0.05)))  # tpot ok, itl p99 0.0496
    assert not slo.meets(make_record(status="error"))
    assert SLO(0.2, 0.05).meets(make_record(itl=(0.01, 0.05)))
    assert slo.meets(make_record(itl=()))  # one token: no TPOT, no ITL


def test_slo_rejects_non_positive_targets():
    with pytest.raises(ValueError, match="SLO target tpot_s must be > 0 seconds, got 0"):
        SLO(1.0, 0)


def test_summarize_counts_every_status_and_pools_itl():
    records = [
        make_record(0, ttft=0.1, itl=(0.02, 0.04)),
        make_record(1, ttft=0.3, itl=(0.02,)),
        make_record(2, status="error"),
        make_record(3, status="timeout"),
    ]
    agg = summarize(records, SLO(0.2, 0.05), duration_s=2.0)
    assert agg["num_requests"] == 4
    assert agg["status"] == {"ok": 2, "error": 1, "timeout": 1}
    assert agg["request_throughput"] == 1.0
    assert agg["output_token_throughput"] == 2.5
    assert agg["prompt_token_throughput"] == 10.0
    assert agg["ttft_s"]["count"] == 2
    assert agg["ttft_s"]["mean"] == pytest.approx(0.2)
    assert agg["ttft_s"]["max"] == 0.3
    assert agg["itl_s"]["count"] == 3
    assert agg["itl_s"]["p50"] == 0.02
    assert agg["e2e_s"]["max"] == pytest.approx(0.32)
    assert agg["slo_attainment"] == 0.25  # failures count as misses
    assert agg["slo"] == {"ttft_s": 0.2, "tpot_s": 0.05, "itl_p99_s": None}


def test_summarize_empty_and_by_class():
    empty = summarize([], SLO(1, 1), 0.0)
    assert empty["slo_attainment"] is None
    assert empty["ttft_s"] == {
        "count": 0,
        "mean": None,
        "p50": None,
        "p90": None,
        "p99": None,
        "max": None,
    }
    records = [make_record(0, "chat"), make_record(1, "doc", ttft=5.0), make_record(2, "chat")]
    by_class = summarize_by_class(records, SLO(1, 1), 1.0)
    assert list(by_class) == ["chat", "doc"]
    assert by_class["chat"]["num_requests"] == 2
    assert by_class["doc"]["slo_attainment"] == 0.0


def test_records_round_trip_through_json():
    record = make_record(status="timeout")
    data = msgspec.json.encode(record)
    assert msgspec.json.decode(data, type=RequestRecord) == record


def test_goodput_is_highest_rate_before_the_first_miss():
    assert goodput({0.5: 1.0, 1: 0.95, 2: 0.9, 4: 0.5, 8: 0.95}) == 2
    assert goodput({1: 0.89}) is None
    assert goodput({1: 1.0, 2: None}) == 1
