"""The simulator against hand-computed timelines on a tiny, exactly-known machine."""

import time

import numpy as np
import pytest

from pdserve.bench.metrics import SLO, stats
from pdserve.bench.workload import RequestSpec, generate_requests, named_workload
from pdserve.sim.deployment import Cluster, Deployment
from pdserve.sim.hardware import Accelerator, Link, get_gpu, get_link
from pdserve.sim.kvmath import kv_bytes
from pdserve.sim.latency import Batch, Efficiency, stretch_time
from pdserve.sim.models import ModelSpec, get_model
from pdserve.sim.simulator import simulate
from pdserve.sim.stats import weighted_stats

MODEL = ModelSpec("tiny", 4, 256, 4, 2, 64, 1024, 1000, 4_000_000)
ACCEL = Accelerator("dev", "test device", 1e12, 1e11, 1e10, "pcie-gen4", 1)
EFF = Efficiency(0.5, 0.5, 0.001, 0.0, 0.5, 0.0)
SLO_LOOSE = SLO(10.0, 1.0)


def cluster(link: Link) -> Cluster:
    return Cluster(MODEL, ACCEL, link, EFF, "fp16", "fp16")


def req(index: int, at: float, prompt: int, output: int) -> RequestSpec:
    return RequestSpec(index, at, "t", prompt, output)


def test_one_request_colocated_matches_the_latency_model():
    cl = cluster(get_link("ib-ndr"))
    res = simulate(cl, Deployment(), [req(0, 0.0, 100, 5)], SLO_LOOSE)
    lat = cl.latency(1)
    prefill = lat.iteration(Batch(100, 1, 100 * 50, 0, 1))
    decode = stretch_time(lat.decode_coeffs(1, 101), 4)
    rec = res.records[0]
    assert rec.ttft_s == pytest.approx(prefill, rel=1e-12)
    assert rec.e2e_s == pytest.approx(prefill + decode, rel=1e-12)
    assert rec.tpot_s == pytest.approx(decode / 4, rel=1e-12)
    assert res.aggregates["itl_s"]["count"] == 4


def test_chunked_prefill_takes_one_iteration_per_chunk():
    cl = cluster(get_link("ib-ndr"))
    res = simulate(cl, Deployment(chunk=64), [req(0, 0.0, 200, 1)], SLO_LOOSE)
    lat = cl.latency(1)
    chunks = [(64, 0), (64, 64), (64, 128), (8, 192)]
    want = sum(lat.iteration(Batch(n, int(c + n == 200), n * (c + n / 2), c, 1)) for n, c in chunks)
    assert res.records[0].ttft_s == pytest.approx(want, rel=1e-12)


def test_layerwise_overlap_only_last_layer_adds_when_link_is_fast():
    fast = Link("fast", "", 1e12, 1e12)
    cl = cluster(fast)
    res = simulate(cl, Deployment("disagg"), [req(0, 0.0, 100, 1)], SLO_LOOSE)
    prefill = cl.latency(1).iteration(Batch(100, 1, 100 * 50, 0, 1))
    last_layer = kv_bytes(MODEL, 100, "fp16") / MODEL.num_layers / 1e12
    assert res.records[0].ttft_s == pytest.approx(prefill + last_layer, rel=1e-9)


def test_a_chunked_prompts_kv_streams_under_its_later_chunks():
    """As a prefill worker pushes: each chunk's KV leaves while the chunk runs, not all of it
    under the last chunk. A link that moves the prompt's KV in exactly its prefill time T then
    finishes the body with the prefill, and only the last layer adds: T (1 + 1/layers)."""
    dep, one = Deployment("disagg", chunk=50), [req(0, 0.0, 100, 1)]
    nbytes = kv_bytes(MODEL, 100, "fp16")
    t = simulate(cluster(Link("fast", "", 1e15, 1e15)), dep, one, SLO_LOOSE).records[0].ttft_s
    link = Link("exact", "", nbytes / t, nbytes / t)
    res = simulate(cluster(link), dep, one, SLO_LOOSE)
    # the last layer of the last chunk: half the prompt's, a layer's share
    assert res.records[0].ttft_s == pytest.approx(t * (1 + 0.5 / MODEL.num_layers), rel=1e-6)
    assert res.kv_bytes_sent == pytest.approx(nbytes, rel=1e-9)


def test_slow_link_transfer_dominates_and_is_shared():
    slow = Link("slow", "", 1e6, 1e6)  # 1 MB/s: a 100-token prompt's 204,800 B take 0.2 s
    cl = cluster(slow)
    one = simulate(cl, Deployment("disagg"), [req(0, 0.0, 100, 1)], SLO_LOOSE)
    assert kv_bytes(MODEL, 100, "fp16") == 204_800
    assert one.records[0].ttft_s == pytest.approx(0.2048, rel=1e-9)
    two = simulate(cl, Deployment("disagg"), [req(0, 0.0, 100, 1), req(1, 0.0, 100, 1)], SLO_LOOSE)
    # The port is the bottleneck and never idles: the last KV lands when all 409,600 B are
    # through; sharing it delays the first request beyond its 0.2048 s alone.
    first, last = sorted(r.ttft_s for r in two.records)
    assert last == pytest.approx(0.4096, rel=1e-9)
    assert 0.2048 * 1.5 < first < last
    assert two.kv_bytes_sent == pytest.approx(409_600, rel=1e-9)


def test_fp8_on_the_wire_halves_the_bytes_and_the_transfer_of_a_16_bit_cache():
    """`--kv-compression fp8`, as the simulator and planner see it."""
    slow = Link("slow", "", 1e6, 1e6)
    cl = Cluster(MODEL, ACCEL, slow, EFF, "fp16", "fp16", kv_wire="fp8")
    assert cl.wire_bytes(100) == 102_400  # half of the 204,800 B of the fp16 cache
    one = simulate(cl, Deployment("disagg"), [req(0, 0.0, 100, 1)], SLO_LOOSE)
    assert one.records[0].ttft_s == pytest.approx(0.1024, rel=1e-9)
    assert one.kv_bytes_sent == pytest.approx(102_400, rel=1e-9)


def test_chunking_bounds_the_stall_a_long_prompt_causes():
    cl = cluster(get_link("ib-ndr"))
    reqs = [req(0, 0.0, 16, 200), req(1, 0.05, 4000, 1)]
    whole = simulate(cl, Deployment(), reqs, SLO_LOOSE).aggregates["itl_s"]["max"]
    chunked = simulate(cl, Deployment(chunk=256), reqs, SLO_LOOSE).aggregates["itl_s"]["max"]
    stall = cl.latency(1).iteration(Batch(4001, 2, 4000 * 2000 + 17, 17, 2))
    assert whole == pytest.approx(stall, rel=0.01)
    assert chunked < whole / 5


def test_requests_that_cannot_fit_fail_and_early_stop_times_out():
    cl = Cluster(get_model("llama-3.1-70b"), get_gpu("h100"), get_link("ib-ndr"))
    res = simulate(cl, Deployment(tp=2), [req(0, 0.0, 100_000, 10)], SLO_LOOSE)
    assert res.records[0].status == "error" and "do not fit" in res.records[0].error
    reqs = generate_requests(named_workload("docs"), 60, 0, rate=50)
    res = simulate(cl, Deployment(tp=8), reqs, SLO(0.1, 0.02), stop_after_misses=5)
    statuses = {r.status for r in res.records}
    assert statuses == {"ok", "timeout"} and res.aggregates["slo_attainment"] < 0.5


def test_weighted_stats_match_bench_stats():
    values, weights = [0.3, 0.1, 0.2, 0.1], [2, 3, 0, 5]
    expanded = [v for v, w in zip(values, weights, strict=True) for _ in range(w)]
    assert weighted_stats(values, weights) == pytest.approx(stats(expanded))
    rng = np.random.default_rng(0)
    v, w = rng.random(50), rng.integers(0, 20, 50)
    assert weighted_stats(v, w) == pytest.approx(stats(np.repeat(v, w)))


def test_deployment_validation():
    with pytest.raises(ValueError, match="deployment mode must be one of colocated, disagg"):
        Deployment("split")
    with pytest.raises(ValueError, match="num_decode must be >= 1"):
        Deployment("disagg", num_decode=0)
    assert Deployment("disagg", prefill_tp=8, num_prefill=3, decode_tp=4).num_gpus == 28


@pytest.mark.slow
def test_100k_requests_simulate_in_under_30_cpu_seconds():
    cl = Cluster(get_model("llama-3.1-8b"), get_gpu("h100"), get_link("ib-ndr"))
    reqs = generate_requests(named_workload("mixed"), 100_000, 0, rate=100)
    start = time.process_time()
    res = simulate(cl, Deployment("disagg", num_prefill=2, num_decode=2), reqs, SLO(1.0, 0.05))
    assert time.process_time() - start < 30
    assert res.aggregates["status"]["ok"] == 100_000


def test_conditional_disaggregation_prefills_short_prompts_on_the_decoder():
    cl = cluster(Link("slow", "", 1e6, 1e6))
    dep = Deployment("disagg", local_prefill_threshold=64)
    res = simulate(cl, dep, [req(0, 0.0, 32, 2), req(1, 10.0, 100, 2)], SLO_LOOSE)
    prefill = cl.latency(1).iteration(Batch(32, 1, 32 * 16, 0, 1))
    assert res.records[0].ttft_s == pytest.approx(prefill, rel=1e-12)  # no transfer
    assert res.kv_bytes_sent == pytest.approx(kv_bytes(MODEL, 100, "fp16"), rel=1e-9)
    assert res.records[1].ttft_s == pytest.approx(0.2048, rel=1e-9)


def test_short_prompts_go_to_an_idle_prefill_pool_like_the_router():
    cl = cluster(Link("slow", "", 1e6, 1e6))
    dep = Deployment("disagg", local_prefill_threshold=64, short_prefills_to_idle_pool=True)
    # r0 (long) keeps the pool busy when r1 (short) arrives; r2 (short) comes after both.
    reqs = [req(0, 0.0, 100, 2), req(1, 0.0001, 32, 2), req(2, 10.0, 32, 2)]
    res = simulate(cl, dep, reqs, SLO_LOOSE)
    prefill = cl.latency(1).iteration(Batch(32, 1, 32 * 16, 0, 1))
    sent = kv_bytes(MODEL, 100, "fp16") + kv_bytes(MODEL, 32, "fp16")  # r0 and r2, not r1
    assert res.kv_bytes_sent == pytest.approx(sent, rel=1e-9)
    assert res.records[2].ttft_s > prefill  # r2 paid the transfer: it went through the pool


def test_decode_chunk_sets_the_decoders_step_budget_beside_running_streams():
    with pytest.raises(ValueError, match="decode_chunk size must be >= 1"):
        Deployment("disagg", decode_chunk=0)
    cl = cluster(Link("slow", "", 1e6, 1e6))
    whole = Deployment("disagg", local_prefill_threshold=64)
    chunked = Deployment("disagg", local_prefill_threshold=64, decode_chunk=16)
    alone = [req(0, 0.0, 60, 2)]  # nothing decodes on the decoder: one step, as the engine
    assert simulate(cl, chunked, alone, SLO_LOOSE).records[0].ttft_s == pytest.approx(
        simulate(cl, whole, alone, SLO_LOOSE).records[0].ttft_s, rel=1e-12
    )
    first = simulate(cl, whole, [req(0, 0.0, 20, 400)], SLO_LOOSE).records[0].ttft_s
    beside = [req(0, 0.0, 20, 400), req(1, first + 1e-6, 60, 2)]  # r0 is decoding by then
    w = simulate(cl, whole, beside, SLO_LOOSE).records[1].ttft_s
    c = simulate(cl, chunked, beside, SLO_LOOSE).records[1].ttft_s
    assert c > w  # 4 steps of 15 beside r0's token instead of 1


def test_pool_stays_busy_until_the_kv_has_landed_like_the_router():
    # The router counts a remote request as pending until its first token (after the KV has
    # landed), not only while it computes: a short prompt arriving while r0's KV is still on
    # the (slow) link prefills on the decoder.
    cl = cluster(Link("slow", "", 1e6, 1e6))
    dep = Deployment("disagg", local_prefill_threshold=64, short_prefills_to_idle_pool=True)
    computed = cl.latency(1).prefill(100)
    assert computed < 0.05  # r1 arrives after r0 computed, before its KV landed (0.2048 s)
    res = simulate(cl, dep, [req(0, 0.0, 100, 2), req(1, 0.1, 32, 2)], SLO_LOOSE)
    assert res.kv_bytes_sent == pytest.approx(kv_bytes(MODEL, 100, "fp16"), rel=1e-9)


def test_colocated_replicas_route_around_a_queued_prefill_like_the_router():
    cl = cluster(get_link("ib-ndr"))
    # r0 (long prompt) prefills on one replica, r1 streams on the other; r2 (short) then finds
    # one request on each: fewest in flight would tie, fewest queued prompt tokens does not.
    reqs = [req(0, 0.0, 3000, 2), req(1, 0.0001, 32, 500), req(2, 0.0002, 32, 2)]
    res = simulate(cl, Deployment(replicas=2), reqs, SLO_LOOSE)
    doc, _, chat = sorted(res.records, key=lambda r: r.index)
    assert chat.ttft_s < doc.ttft_s / 10  # it did not wait behind r0's prefill
