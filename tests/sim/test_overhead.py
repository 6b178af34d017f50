"""Serving overhead: how the simulator applies it, its fit, and its place in the profile."""

import json
from argparse import Namespace

import msgspec
import pytest

from pdserve.bench.metrics import SLO
from pdserve.bench.workload import RequestSpec
from pdserve.sim.calibration import load_profile, profile_document, save_overhead
from pdserve.sim.commands import cluster_of
from pdserve.sim.deployment import Cluster, Deployment, ServingOverhead
from pdserve.sim.hardware import Accelerator, get_link
from pdserve.sim.latency import Batch, Efficiency, stretch_time
from pdserve.sim.models import ModelSpec
from pdserve.sim.overhead import (
    OverheadFit,
    describe_overhead,
    fit_overhead,
    interference_rounds,
    probe_groups,
)
from pdserve.sim.profile import Fit, Point
from pdserve.sim.simulator import simulate

MODEL = ModelSpec("tiny", 4, 256, 4, 2, 64, 1024, 1000, 4_000_000)
ACCEL = Accelerator("cpu", "test device", 1e12, 1e11, 1e10, "pcie-gen4", 1)
EFF = Efficiency(0.5, 0.5, 0.001, 0.0, 0.5, 0.0)
SLO_LOOSE = SLO(10.0, 1.0)


def cluster(**serving: ServingOverhead) -> Cluster:
    return Cluster(MODEL, ACCEL, get_link("ib-ndr"), EFF, "fp16", "fp16", serving)


def served(cl: Cluster, dep: Deployment, groups: list[list[int]], output: int = 32):
    """Records of each group of prompts arriving together at an idle deployment, as the probes
    are served (indexes unique over all groups)."""
    out, index = [], 0
    for prompts in groups:
        specs = [RequestSpec(index + i, 0.0, "probe", p, output) for i, p in enumerate(prompts)]
        index += len(prompts)
        out.append(simulate(cl, dep, specs, SLO_LOOSE).records)
    return out


GROUPS = [[32], [128], [224], [32, 128, 224, 32], [128] * 4, [32, 64, 96, 128, 160, 192, 224, 32]]


def test_overhead_delays_the_first_token_and_lengthens_every_step():
    over = ServingOverhead(request_s=0.05, step_s=0.01, seq_s=0.002)
    res = simulate(cluster(colocated=over), Deployment(), [RequestSpec(0, 0.0, "t", 100, 5)],
                   SLO_LOOSE)  # fmt: skip
    lat = cluster().latency(1)
    prefill = lat.iteration(Batch(100, 1, 100 * 50, 0, 1))
    decode = stretch_time(lat.decode_coeffs(1, 101), 4)
    rec = res.records[0]
    assert rec.ttft_s == pytest.approx(0.05 + prefill + 0.012, rel=1e-12)
    assert rec.tpot_s == pytest.approx(decode / 4 + 0.012, rel=1e-12)
    assert rec.arrival_s == 0.0  # TTFT counts from the send, not from reaching the engine
    batch = Batch(3, 3, 0, 300, 3)  # a step of three sequences pays seq_s three times
    served_step = cluster(colocated=over).latency(1, "colocated").iteration(batch)
    assert served_step == pytest.approx(lat.iteration(batch) + 0.01 + 3 * 0.002, rel=1e-12)


def test_overhead_applies_only_to_its_mode():
    cl = cluster(disagg=ServingOverhead(0.5, 0.1, 0.01))
    reqs = [RequestSpec(0, 0.0, "t", 100, 5)]
    assert (
        simulate(cl, Deployment(), reqs, SLO_LOOSE).records
        == simulate(cluster(), Deployment(), reqs, SLO_LOOSE).records
    )
    assert cl.latency(1, "colocated").eff == EFF
    assert cl.latency(1, "disagg").eff.iteration_overhead_s == pytest.approx(0.101)
    assert cl.latency(1, "disagg").eff.per_seq_overhead_s == pytest.approx(0.01)
    with pytest.raises(ValueError, match="must be >= 0 seconds"):
        ServingOverhead(-0.01, 0.0)


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_fit_recovers_a_known_overhead(mode):
    dep = Deployment.served(mode)
    true = ServingOverhead(0.07, 0.004, 0.0015)
    fit = fit_overhead(cluster(), dep, served(cluster(**{mode: true}), dep, GROUPS))
    # Exact although a group's requests do not all decode together throughout (the first to
    # arrive prefills alone; disaggregated, the short ones prefill on D in 64-token chunks).
    assert fit.overhead.request_s == pytest.approx(0.07, rel=1e-6)
    assert fit.overhead.step_s == pytest.approx(0.004, rel=1e-6)
    assert fit.overhead.seq_s == pytest.approx(0.0015, rel=1e-6)
    assert fit.probes == 19 and list(fit.raw_tpot_s) == [1, 4, 8]


def test_fit_takes_medians_and_never_goes_negative():
    dep = Deployment()
    groups = served(cluster(colocated=ServingOverhead(0.07, 0.004)), dep, GROUPS)
    slow = groups[0][0].ttft_s + 5.0  # one disturbed request
    groups[0][0] = msgspec.structs.replace(groups[0][0], ttft_s=slow)
    fit = fit_overhead(cluster(), dep, groups)
    assert fit.overhead.request_s == pytest.approx(0.07)
    assert fit.overhead.seq_s == pytest.approx(0.0, abs=1e-9)
    # Served faster than the bare engine: the profile is too slow; no negative overhead.
    fast = [[msgspec.structs.replace(r, tpot_s=r.tpot_s - 0.01) for r in g]
            for g in served(cluster(), dep, GROUPS)]  # fmt: skip
    fit = fit_overhead(cluster(), dep, fast)
    assert fit.overhead == ServingOverhead(0.0, 0.0, 0.0)
    assert fit.raw_tpot_s[1] == pytest.approx(-0.01)
    assert "profile may be slow" in describe_overhead(fit)
    with pytest.raises(ValueError, match=">= 2 output tokens, some sent alone"):
        fit_overhead(cluster(), dep, [groups[3]])


def test_probe_groups_start_with_a_lone_warm_up_and_interleave_sizes():
    groups = probe_groups(sizes=(1, 2), prompts=(32, 128), output=16, repeats=2)
    assert [[(s.index, s.prompt_tokens) for s in g] for g in groups] == [
        [(0, 32)], [(1, 128)], [(2, 32), (3, 128)], [(4, 32)], [(5, 128), (6, 32)],
    ]  # fmt: skip
    assert {s.output_tokens for g in groups for s in g} == {16}


def test_interference_rounds_send_short_prompts_while_a_document_prefills():
    rounds = interference_rounds(rounds=2)
    assert len(rounds) == 2 and [len(r) for r in rounds] == [9, 9]
    indexes = [s.index for r in rounds for s in r]
    assert len(set(indexes)) == len(indexes)
    assert not set(indexes) & {s.index for g in probe_groups() for s in g}
    for r in rounds:
        (doc,) = [s for s in r if s.prompt_tokens > 256]  # the prefill pool's
        early = [s for s in r if s.arrival_s < doc.arrival_s]
        late = [s for s in r if s.arrival_s > doc.arrival_s]
        # streams decode when the document arrives; short prompts arrive while it prefills
        assert early and all(s.output_tokens >= 64 for s in early)
        assert late and all(s.prompt_tokens < 256 for s in late)


def test_profile_carries_the_overhead_per_mode_for_this_machine_only(tmp_path):
    hardware = {**ACCEL.__dict__, "loopback_bytes_per_s": 1e9}
    points = [Point("prefill", 1, 32, 0.1), Point("decode", 1, 64, 0.05)]
    doc = profile_document(hardware, MODEL, "fp16", points, Fit(EFF, 0.0, 0.0), 8)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    assert load_profile(path).serving == {}
    colocated = ServingOverhead(0.06, 0.005, 0.001)
    save_overhead(path, "colocated", OverheadFit(colocated, 0.06, {1: 0.006, 4: 0.009}, 9))
    save_overhead(path, "disagg", OverheadFit(ServingOverhead(0.09), 0.09, {1: -0.002}, 9))
    assert load_profile(path).serving == {"colocated": colocated, "disagg": ServingOverhead(0.09)}
    args = Namespace(profile=str(path), gpu=None, model=None, dtype="bf16", kv_dtype=None,
                     link="loopback", bandwidth_gbps=None)  # fmt: skip
    assert cluster_of(args).overhead("disagg") == ServingOverhead(0.09)
    gpu = cluster_of(replace_ns(args, gpu="h100", link="ib-ndr"))
    assert gpu.serving == {}  # measured on this machine's serving path, not the GPU's


def replace_ns(ns: Namespace, **kw) -> Namespace:
    return Namespace(**{**vars(ns), **kw})


def test_served_deployment_follows_the_real_defaults():
    import argparse

    from pdserve.config import EngineConfig
    from pdserve.launch.cli import register
    from pdserve.launch.local import worker_config
    from pdserve.router.config import RouterConfig

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    serve = parser.parse_args(["serve"])
    dep, router = Deployment.served("disagg"), RouterConfig()
    assert dep.local_prefill_threshold == router.local_prefill_threshold
    assert dep.short_prefills_to_idle_pool == router.short_prefills_to_idle_pool
    assert dep.decode_chunk == serve.decode_chunk_size
    for d in (dep, Deployment.served("colocated")):
        assert d.max_num_seqs == EngineConfig.max_num_seqs
    assert serve.chunk_size is None  # each worker takes its role's default
    both = parser.parse_args(["worker", "--router", "127.0.0.1:1", "--role", "both"])
    assert Deployment.served("colocated").chunk == worker_config(both).engine.chunk_size
    assert Deployment.served("colocated").replicas == serve.colocated_workers
    two = Deployment.served("colocated", 2)  # --colocated-workers 2
    assert (two.replicas, two.num_gpus, two.max_num_seqs) == (2, 2, EngineConfig.max_num_seqs)
