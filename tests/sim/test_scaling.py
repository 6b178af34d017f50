"""Pools resized while the simulation runs (`pdserve.sim.scaling`): the static path equals
`simulate`, start-up delays and drains on a tiny, exactly-known machine, device-seconds."""

from dataclasses import replace

import pytest

from pdserve.bench.metrics import SLO
from pdserve.bench.workload import RequestSpec, generate_requests, named_workload
from pdserve.sim.deployment import Cluster, Deployment
from pdserve.sim.hardware import Accelerator, get_gpu, get_link
from pdserve.sim.latency import Batch, Efficiency
from pdserve.sim.models import ModelSpec, get_model
from pdserve.sim.scaling import Phase, simulate_scaled
from pdserve.sim.simulator import simulate

MODEL = ModelSpec("tiny", 4, 256, 4, 2, 64, 1024, 1000, 4_000_000)
ACCEL = Accelerator("dev", "test device", 1e12, 1e11, 1e10, "pcie-gen4", 1)
TINY = Cluster(MODEL, ACCEL, get_link("ib-ndr"), Efficiency(0.5, 0.5, 0.001, 0.0, 0.5, 0.0),
               "fp16", "fp16")  # fmt: skip
GPU = Cluster(get_model("llama-3.1-70b"), get_gpu("h100"), get_link("ib-ndr"))
SLO_LOOSE = SLO(10.0, 1.0)


def req(index: int, at: float, prompt: int, output: int) -> RequestSpec:
    return RequestSpec(index, at, "t", prompt, output)


@pytest.mark.parametrize(
    "dep",
    [
        Deployment("disagg", prefill_tp=4, decode_tp=4, num_prefill=2, num_decode=1),
        replace(Deployment.served("disagg"), prefill_tp=4, decode_tp=4, num_decode=2),
    ],
    ids=["plain", "served-conditional"],
)
def test_a_static_deployment_through_the_scaling_path_equals_simulate(dep):
    reqs = generate_requests(named_workload("mixed"), 600, 3, rate=25)
    slo = SLO(0.5, 0.025)
    want = simulate(GPU, dep, reqs, slo)
    same = [(dep.num_prefill, dep.num_decode)]
    for controller in (None, lambda obs, now: same[0]):
        got = simulate_scaled(GPU, dep, reqs, slo, controller, interval_s=2.0)
        assert got.result.records == want.records
        assert got.result.aggregates == want.aggregates
        assert got.result.utilization == pytest.approx(want.utilization, rel=1e-12)
        assert got.device_s == pytest.approx(
            dep.num_gpus * want.aggregates["duration_s"], rel=1e-12
        )
        assert {(s.prefill, s.decode) for s in got.series} == set(same)
        assert len(got.series) == int(reqs[-1].arrival_s // 2.0)


def test_a_removed_decoder_drains_what_it_holds_and_is_billed_until_then():
    dep = Deployment("disagg", num_prefill=1, num_decode=2)
    # r0 and r1 decode on d0 and d1; at the first tick (0.2 s) one decoder goes: of equals the
    # newest, d1. r2 arrives after that and must go to d0.
    reqs = [req(0, 0.0, 100, 3000), req(1, 0.0, 100, 1000), req(2, 0.5, 100, 10)]
    run = simulate_scaled(TINY, dep, reqs, SLO_LOOSE, lambda obs, now: (1, 1), 0.2, 0.0)
    finish = {r.index: r.arrival_s + r.e2e_s for r in run.result.records}
    p0, d0, d1 = run.leases
    assert [x.inst.name for x in run.leases] == ["p0", "d0", "d1"]
    assert 0.2 < finish[1] < finish[0]  # d1 still held r1 when it was removed
    assert d1.phase is Phase.GONE and d1.ended == pytest.approx(finish[1], rel=1e-12)
    end = max(finish.values())
    assert p0.ended == d0.ended == end
    assert run.device_s == pytest.approx(2 * end + finish[1], rel=1e-12)
    assert [(s.prefill, s.decode) for s in run.series] == [(1, 1), (1, 1)]  # ticks 0.2, 0.4


def test_an_added_prefill_instance_serves_only_after_its_startup():
    dep = Deployment("disagg", num_prefill=1, num_decode=1)
    # p1 is asked for at 0.2 s and serves from 0.7 s. The pair at 0.3 s both queue on p0; of
    # the pair at 0.9 s the second finds p0 busy and takes p1: p1 computes one prompt.
    reqs = [req(0, 0.3, 500, 2), req(1, 0.3, 500, 2), req(2, 0.9, 500, 2), req(3, 0.9, 500, 2)]
    run = simulate_scaled(TINY, dep, reqs, SLO_LOOSE, lambda obs, now: (2, 1), 0.2, 0.5)
    p1 = run.leases[-1]
    assert (p1.inst.name, p1.started, p1.phase) == ("p1", 0.2, Phase.LIVE)
    one_prompt = TINY.latency(1).iteration(Batch(500, 1, 500 * 250, 0, 1))
    assert p1.inst.busy_time == pytest.approx(one_prompt, rel=1e-12)
    assert [s.time_s for s in run.series] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert [(s.prefill, s.decode) for s in run.series] == [(2, 1)] * 4


def test_a_shrink_cancels_an_instance_still_starting_first():
    dep = Deployment("disagg", num_prefill=1, num_decode=1)
    wants = iter([(2, 1), (1, 1)])
    reqs = [req(0, 0.0, 100, 2), req(1, 0.5, 100, 2)]
    run = simulate_scaled(TINY, dep, reqs, SLO_LOOSE, lambda obs, now: next(wants), 0.2, 1.0)
    p1 = run.leases[-1]
    assert (p1.inst.name, p1.phase, p1.started, p1.ended) == ("p1", Phase.GONE, 0.2, 0.4)
    assert p1.inst.busy_time == 0.0 and run.leases[0].phase is Phase.LIVE


def test_observations_count_arrivals_latencies_and_instances_starting():
    dep = Deployment("disagg", num_prefill=1, num_decode=1)
    seen = []

    def controller(obs, now):
        seen.append(obs)
        return 2, 1

    reqs = [req(0, 0.0, 100, 3), req(1, 0.05, 200, 5), req(2, 0.25, 100, 3)]
    run = simulate_scaled(TINY, dep, reqs, SLO_LOOSE, controller, 0.2, 1.0)
    first = seen[0]
    assert (first.window_s, first.lengths, first.prefill, first.decode) == (
        0.2, [(100, 3), (200, 5)], 1, 1)  # fmt: skip
    lo, hi = sorted(r.ttft_s for r in run.result.records if r.index < 2)
    assert first.ttft_p90 == pytest.approx(0.1 * lo + 0.9 * hi, rel=1e-12)  # numpy's p90 of two
    lo, hi = sorted(r.tpot_s for r in run.result.records if r.index < 2)
    assert first.tpot_p90 == pytest.approx(0.1 * lo + 0.9 * hi, rel=1e-12)  # both done by 0.2 s
    assert seen[0].queued_tokens == 0 and run.series[0].rate == 10.0
    assert len(seen) == 1  # the only tick at or before the last arrival


def test_bad_requests_for_the_scaling_path_say_what_to_do():
    reqs = [req(0, 0.0, 100, 2), req(1, 1.0, 100, 2)]
    with pytest.raises(ValueError, match="only a disaggregated deployment"):
        simulate_scaled(TINY, Deployment(), reqs, SLO_LOOSE)
    with pytest.raises(ValueError, match="at least one instance in each pool"):
        simulate_scaled(TINY, Deployment("disagg"), reqs, SLO_LOOSE, lambda o, t: (0, 1), 0.5)
    with pytest.raises(ValueError, match="interval_s > 0"):
        simulate_scaled(TINY, Deployment("disagg"), reqs, SLO_LOOSE, interval_s=0.0)
