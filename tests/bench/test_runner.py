import functools
import statistics

import pytest

from pdserve.bench.client import Endpoint
from pdserve.bench.metrics import SLO
from pdserve.bench.prompts import approximate_builder
from pdserve.bench.runner import LoadConfig, parse_rates, run_load, run_sweep
from pdserve.bench.workload import LengthDist, Workload, generate_requests

from .stub_server import StubConfig, StubServer

TINY = functools.partial(
    generate_requests, Workload.from_lengths(LengthDist.fixed(8), LengthDist.fixed(4))
)
LOOSE = SLO(ttft_s=10.0, tpot_s=10.0)


def run(url: str, load: LoadConfig, slo: SLO = LOOSE):
    return run_load(Endpoint(url), TINY, approximate_builder(0), load, slo, progress=False)


def test_open_loop_sends_every_request_on_schedule():
    load = LoadConfig("gamma", rate=40.0, burstiness=0.1, num_requests=12, seed=5)
    with StubServer(StubConfig(ttft_s=0.01, itl_s=0.005)) as url:
        result = run(url, load)
    assert [r.index for r in result.records] == list(range(12))
    assert [r.status for r in result.records] == ["ok"] * 12
    expected = [s.arrival_s for s in TINY(12, 5, "gamma", 40.0, 0.1)]
    assert [r.arrival_s for r in result.records] == expected
    lateness = [r.start_s - r.arrival_s for r in result.records]
    assert min(lateness) >= 0
    assert statistics.median(lateness) < 0.005
    assert result.aggregates["status"] == {"ok": 12, "error": 0, "timeout": 0}


def test_closed_loop_keeps_that_many_in_flight():
    load = LoadConfig(concurrency=2, num_requests=6)
    with StubServer(StubConfig(ttft_s=0.05, itl_s=0.0)) as url:
        result = run(url, load)
    assert [r.index for r in result.records] == list(range(6))
    # In flight at each send (the request itself included): never more than two, often two.
    spans = [(r.start_s, r.start_s + r.e2e_s) for r in result.records]
    in_flight = [sum(s <= t < e for s, e in spans) for t, _ in spans]
    assert max(in_flight) == 2
    assert all(0 <= r.start_s - r.arrival_s < 0.01 for r in result.records)  # due when a slot frees


def test_duration_bounds_open_and_closed_loops():
    with StubServer(StubConfig(ttft_s=0.05, itl_s=0.0)) as url:
        open_loop = run(url, LoadConfig(rate=50.0, duration_s=0.3, seed=2))
        closed = run(url, LoadConfig(concurrency=1, duration_s=0.22))
    due = [
        s
        for s in TINY(LoadConfig(rate=50.0, duration_s=0.3).request_count, 2, "poisson", 50.0, 1.0)
        if s.arrival_s < 0.3
    ]
    assert len(open_loop.records) == len(due)
    # One at a time, 50 ms each (a little more on a busy machine): 4 or 5 started before 0.22 s.
    assert len(closed.records) in (4, 5)
    assert all(r.ok for r in closed.records)


@pytest.mark.slow
def test_sweep_finds_the_stub_capacity():
    # 2 slots x (20 ms + 3 x 10 ms) per request = 40 req/s capacity. Near-regular arrivals:
    # below capacity nobody queues (TTFT 20 ms); above it the queue grows by 5+ ms a request.
    stub = StubConfig(ttft_s=0.02, itl_s=0.01, capacity=2)
    load = LoadConfig("gamma", burstiness=0.01, num_requests=30, seed=0)
    slo = SLO(ttft_s=0.045, tpot_s=1.0)
    with StubServer(stub) as url:
        result = run_sweep(
            Endpoint(url), TINY, approximate_builder(0), load, slo, [15, 30, 50, 60], progress=False
        )
    attained = [run.aggregates["slo_attainment"] for run in result.runs]
    # Goodput's own bar (>= 90 % within the SLO): a loaded machine may delay one request of 30.
    assert min(attained[:2]) >= 0.9
    assert max(attained[2:]) < 0.5
    assert result.goodput == 30
    assert [len(run.records) for run in result.runs] == [30] * 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "--num-requests N or --duration SECONDS"),
        ({"num_requests": 0}, "--num-requests must be >= 1"),
        ({"num_requests": 1, "concurrency": 0}, "--concurrency must be >= 1"),
        ({"duration_s": 5.0}, "--duration needs a finite --rate"),
        ({"num_requests": 1, "arrival": "bursty"}, "unknown arrival process 'bursty'"),
    ],
)
def test_load_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoadConfig(**kwargs)


def test_parse_rates():
    assert parse_rates("0.5,1, 2,4") == [0.5, 1.0, 2.0, 4.0]
    for bad in ("", "a,b", "1,-2", "1,inf"):
        with pytest.raises(ValueError, match="--sweep takes positive request rates"):
            parse_rates(bad)


def test_unreachable_server_is_a_clear_error():
    with StubServer(StubConfig()) as url:
        pass
    with pytest.raises(ValueError, match="cannot reach .* is the server running"):
        run(url, LoadConfig(num_requests=1))
