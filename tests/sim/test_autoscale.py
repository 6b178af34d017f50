"""The autoscaler's policy (`pdserve.sim.autoscale`) on a GPU preset, alone and driving a short
simulated ramp (`pdserve.sim.scaling`)."""

import re

import numpy as np
import pytest

from pdserve.bench.metrics import SLO
from pdserve.bench.workload import RequestSpec
from pdserve.sim.autoscale import Autoscaler, Observation
from pdserve.sim.deployment import Cluster, Deployment
from pdserve.sim.hardware import get_gpu, get_link
from pdserve.sim.models import get_model
from pdserve.sim.scale_policy import ScaleBounds, ScalePolicy
from pdserve.sim.scaling import Phase, controlled_by, simulate_scaled

# Llama-3.1-70B on H100, TP 4 per instance: one prefill instance computes a 2,048-token prompt in
# ~0.14 s, so it keeps TTFT p90 under 0.8 s up to ~6 req/s.
CLUSTER = Cluster(get_model("llama-3.1-70b"), get_gpu("h100"), get_link("ib-ndr"))
BASE = Deployment("disagg", prefill_tp=4, decode_tp=4)
SLO_ = SLO(1.0, 0.04)
PROMPT, OUTPUT = 2048, 256


def make_scaler(max_prefill=8, max_decode=4, cooldown=30.0, min_prefill=1, min_decode=1):
    bounds = ScaleBounds(min_prefill, max_prefill, min_decode, max_decode)
    policy = ScalePolicy(SLO_, bounds, interval_s=10.0, cooldown_s=cooldown, horizon_s=30.0,
                         max_sim_requests=300)  # fmt: skip
    return Autoscaler(CLUSTER, BASE, policy, seed=0)


def observed(rate: float, prefill: int, decode: int, **seen) -> Observation:
    return Observation(10.0, [(PROMPT, OUTPUT)] * round(rate * 10), prefill, decode, **seen)


def test_a_low_rate_stays_at_the_minimum():
    decision = make_scaler().decide(observed(1.0, 1, 1), 0.0)
    assert (decision.prefill, decision.decode, decision.target) == (1, 1, (1, 1))
    assert decision.predicted.ttft_p90 <= 0.8 * SLO_.ttft_s


def test_a_rate_that_breaks_ttft_at_one_prefill_worker_asks_for_more():
    probe = make_scaler()
    load = probe.synthetic_load(observed(20.0, 1, 1))
    assert probe.predict(1, 4, load).ttft_p90 > SLO_.ttft_s  # one worker misses, however many D
    decision = make_scaler().decide(observed(20.0, 1, 1), 0.0)
    assert decision.prefill > 1 and decision.prefill == decision.target[0]  # grown at once
    assert decision.predicted.ttft_p90 <= 0.8 * SLO_.ttft_s
    text = "; ".join(decision.reasons)
    assert "20.00 req/s" in text and f"prompt p50 {PROMPT}" in text
    assert f"{decision.prefill}P+{decision.decode}D" in text
    assert re.search(r"TTFT p90 \d+\.\d\d s", text) and re.search(r"TPOT p90 \d+ ms", text)


def test_a_pool_shrinks_after_the_cooldown_to_the_most_its_decisions_asked_for():
    scaler = make_scaler(cooldown=30.0)  # decisions every 10 s
    grown = scaler.decide(observed(40.0, 1, 1), 0.0)
    p, d = grown.prefill, grown.decode
    assert p >= 3
    history = []
    for now in np.arange(10.0, 101.0, 10.0):  # the load is gone: the target is 1P+1D
        decision = scaler.decide(observed(1.0, p, d), float(now))
        assert decision.target == (1, 1)
        if decision.prefill == p > 1:  # kept although the target is lower: it says why
            assert any("cooldown" in r for r in decision.reasons)
        p, d = decision.prefill, decision.decode
        history.append(p)
    # The 40 req/s target stays in the 30 s window until 40 s; then every decision of the
    # window asked for 1P.
    top = grown.prefill
    assert history == [top, top, top] + [1] * 7


def test_bounds_are_respected_and_said():
    capped = make_scaler(max_prefill=2, max_decode=2).decide(
        observed(40.0, 1, 1, ttft_p90=5.0, tpot_p90=0.1), 0.0
    )
    assert (capped.prefill, capped.decode) == (2, 2)
    assert any("2P+2D" in r for r in capped.reasons)
    floor = make_scaler(min_prefill=2, min_decode=2, max_prefill=4, max_decode=4)
    idle = floor.decide(Observation(10.0, [], 1, 1), 0.0)  # no arrivals: the minimum
    assert (idle.prefill, idle.decode) == (2, 2) and "no arrivals" in idle.reasons[0]
    with pytest.raises(ValueError, match="--max-prefill"):
        ScaleBounds(2, 1, 1, 1)


def ramp(seed: int = 0) -> list[RequestSpec]:
    """Poisson arrivals at 1 req/s for 60 s, 15 req/s for 60 s, then 1 req/s for 120 s."""
    rng = np.random.default_rng(seed)
    times = []
    for start, end, rate in ((0, 60, 1.0), (60, 120, 15.0), (120, 240, 1.0)):
        n = rng.poisson(rate * (end - start))
        times += sorted(rng.uniform(start, end, n))
    return [RequestSpec(i, float(t), "ramp", PROMPT, OUTPUT) for i, t in enumerate(times)]


def test_pools_grow_during_a_ramp_and_shrink_after_it():
    decisions = []
    run = simulate_scaled(CLUSTER, BASE, ramp(), SLO_, controlled_by(make_scaler(), decisions),
                          interval_s=10.0, startup_s=5.0)  # fmt: skip
    counts = {round(s.time_s): (s.prefill, s.decode) for s in run.series}
    assert counts[50] == (1, 1)  # before the ramp
    top = max(p for t, (p, _) in counts.items() if 60 < t <= 130)
    assert top >= 2  # grown during the ramp
    assert counts[max(counts)][0] < top  # and shrunk after it
    started = [x for x in run.leases if x.started > 0]
    assert started and any(x.phase is Phase.GONE and x.ended < 240 for x in started)
    assert len(decisions) == len(run.series)
    # Billed: less than running the largest pools all the time.
    end = max(r.arrival_s + r.e2e_s for r in run.result.records)
    assert run.device_s < (top + max(d for _, d in counts.values())) * 4 * end
    assert run.result.aggregates["slo_attainment"] > 0.5
