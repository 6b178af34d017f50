"""Prefill pipeline parallelism in the latency model, the simulator and the planner's shapes:
the bubble, the activations' hop, memory per stage, KV over every stage's ports, stages that
share one stage's devices (as `pdserve serve` pins them on a machine short of cores), refusals."""

import json
import shlex
from dataclasses import replace

import pytest

from pdserve.bench.metrics import SLO
from pdserve.bench.workload import RequestSpec
from pdserve.cli import build_parser, main
from pdserve.sim.deployment import Cluster, Deployment
from pdserve.sim.hardware import Accelerator, Link, get_gpu, get_link
from pdserve.sim.kvmath import kv_bytes
from pdserve.sim.latency import Batch, Efficiency, pipeline_s
from pdserve.sim.models import ModelSpec, get_model
from pdserve.sim.report import serve_command
from pdserve.sim.shapes import Shape, micro_batch, pipelines
from pdserve.sim.simulator import Loop, simulate

MODEL = ModelSpec("tiny", 4, 256, 4, 2, 64, 1024, 1000, 4_000_000)
ACCEL = Accelerator("dev", "test device", 1e12, 1e11, 1e10, "pcie-gen4", 1)
EFF = Efficiency(0.5, 0.5, 0.001, 0.0, 0.5, 0.0)
SLO_LOOSE = SLO(10.0, 1.0)
FAST = Link("fast", "", 1e12, 1e12)


def tiny(link: Link = FAST) -> Cluster:
    return Cluster(MODEL, ACCEL, link, EFF, "fp16", "fp16")


def test_the_bubble_is_p_minus_1_stage_times_and_hops():
    # m micro-batches through P stages: (m + P - 1) x stage + (P - 1) x hop
    assert pipeline_s(0.25, 8, 2, 0.125) == 2.375
    assert pipeline_s(0.25, 8, 4, 0.125) == 3.125
    assert pipeline_s(0.25, 8, 1, 0.125) == 2.0  # no pipeline: no bubble, no hop


def test_activations_hop_over_the_network_once_the_pipeline_spans_nodes():
    cl = Cluster(get_model("llama-3.1-70b"), get_gpu("h100"), get_link("100gbe"))
    across = cl.latency(8, pp=2)  # 16 GPUs: two nodes, one 100 GbE port each
    assert across.activation_bytes(2048) == 2048 * 8192 * 2 == 33_554_432
    assert across.stage_link.name == "100gbe"
    assert across.hop_s(2048) == pytest.approx(10e-6 + 33_554_432 / 11e9, rel=1e-12)
    within = cl.latency(4, pp=2)  # 8 GPUs: one node, NVLink between the stages
    assert within.stage_link.name == "nvlink4"
    assert within.hop_s(2048) == pytest.approx(1e-6 + 33_554_432 / (4 * 720e9), rel=1e-12)
    assert (across.devices, across.gpus, across.stage_layers) == (16, 8, 40)


def test_a_stage_holds_its_layers_weights_and_kv():
    one, two = tiny().latency(1), tiny().latency(1, pp=2)
    # 9e9 B usable; weights 8e6 B (4M params in fp16); KV 2,048 B per token (4 layers)
    assert one.kv_capacity_tokens == (9e9 - 8e6) // 2048 == 4_390_625
    assert two.kv_capacity_tokens == int((9e9 - 4e6) / 1024) == 8_785_156
    three = tiny().latency(1, pp=3)  # 2 + 1 + 1 layers: the largest stage sets the pace
    assert three.stage_layers == 2
    assert three.kv_capacity_tokens == two.kv_capacity_tokens


def test_a_chunk_that_samples_waits_for_every_stage_the_others_only_for_stage_0():
    lat = tiny().latency(1, pp=2)
    first = Batch(64, 0, 64 * 32, 0, 1)
    last = Batch(64, 1, 64 * (192 + 32), 192, 1)
    assert lat.iteration(first) == lat.stage(first)
    assert lat.iteration(last) == pipeline_s(lat.stage(last), 1, 2, lat.hop_s(64))
    # a stage's pass is half the layers' work plus the whole per-pass overhead
    whole = tiny().latency(1)
    assert lat.stage(first) - 0.001 == pytest.approx((whole.stage(first) - 0.001) / 2, rel=1e-12)


def test_simulated_ttft_of_a_pipelined_prompt_is_its_chunks_through_the_stages():
    cl = tiny()
    dep = Deployment("disagg", prefill_pp=2, chunk=64, decode_tp=2)  # two ports at each end
    res = simulate(cl, dep, [RequestSpec(0, 0.0, "t", 256, 1)], SLO_LOOSE)
    lat = cl.latency(1, "disagg", pp=2)
    chunks = [lat.stage(Batch(64, 0, 64 * (c + 32), c, 1)) for c in (0, 64, 128)]
    final = pipeline_s(lat.stage(Batch(64, 1, 64 * (192 + 32), 192, 1)), 1, 2, lat.hop_s(64))
    # the last chunk's last layer (the earlier chunks' went under the chunks after them)
    last_layer = kv_bytes(MODEL, 64, "fp16") / MODEL.num_layers / (2 * 1e12)  # two ports
    assert res.records[0].ttft_s == pytest.approx(sum(chunks) + final + last_layer, rel=1e-9)
    assert lat.prefill(256, chunk=64) == pytest.approx(sum(chunks) + final, rel=1e-12)


def test_stages_that_share_one_stages_devices_overlap_nothing():
    # (a stage gathers its own layers' cached KV: 1/P of the per-cached-token cost)
    cl = replace(tiny(), eff=replace(EFF, per_cached_token_s=1e-7))
    shared, one = cl.latency(1, pp=2, shared_stages=True), cl.latency(1)
    first, last = Batch(64, 0, 64 * 32, 0, 1), Batch(64, 1, 64 * (192 + 32), 192, 1)
    for batch in (first, last):  # every step: both stages' passes in turn and the hop
        assert shared.iteration(batch) == 2 * shared.stage(batch) + shared.hop_s(64)
    # the whole model's work once, and the second stage's per-pass overhead (1 ms); a step that
    # samples costs the output head in each stage's pass (as any pipeline's, < 1 % of a chunk)
    head = 2 * MODEL.vocab_size * MODEL.hidden_size / (ACCEL.peak_flops * EFF.mfu)
    for batch, extra in ((first, 0.0), (last, head)):
        assert shared.iteration(batch) == pytest.approx(
            one.iteration(batch) + 0.001 + shared.hop_s(64) + extra, rel=1e-12
        )
    assert (shared.devices, cl.latency(1, pp=2).devices) == (1, 2)
    assert shared.kv_capacity_tokens == pytest.approx(one.kv_capacity_tokens, abs=1)
    # simulated: a prompt of 4 chunks takes one process's time, a pass and a hop more a chunk,
    # where stages of their own devices would have overlapped its chunks
    alone = [RequestSpec(0, 0.0, "t", 256, 1)]

    def ttft(**pp) -> float:
        return (
            simulate(cl, Deployment("disagg", chunk=64, **pp), alone, SLO_LOOSE).records[0].ttft_s
        )

    base, piped = ttft(), ttft(prefill_pp=2, decode_tp=2)
    assert ttft(prefill_pp=2, prefill_pp_shared=True) == pytest.approx(
        base + 4 * (0.001 + shared.hop_s(64)) + head, rel=1e-9
    )
    assert piped < base
    dep = Deployment("disagg", prefill_pp=2, prefill_pp_shared=True)
    assert (dep.num_gpus, dep.label) == (2, "disaggregated 1P x TP1 PP2 (shared) : 1D x TP1")


def test_kv_leaves_over_every_stages_ports():
    link = Link("slow", "", 1e9, 1e9)
    dep = Deployment("disagg", prefill_pp=2, decode_tp=2)
    loop = Loop(tiny(link), dep, 8192, SLO_LOOSE)
    assert loop.new_instance("prefill", 0).link_bw == 2e9
    assert Loop(tiny(link), Deployment("disagg"), 8192, SLO_LOOSE).front[0].link_bw == 1e9


def test_a_pipelined_deployment_counts_every_stages_devices():
    dep = Deployment("disagg", prefill_tp=8, prefill_pp=2, num_prefill=2, decode_tp=8)
    assert dep.num_gpus == 2 * 16 + 8
    assert dep.label == "disaggregated 2P x TP8 PP2 : 1D x TP8"
    cmd, note = serve_command(dep)
    assert "--prefill-tp 8 --decode-tp 8 --prefill-pp 2" in cmd
    assert "pushing its own layers' KV" in note


def test_micro_batches_fill_the_pipeline_or_it_is_not_searched():
    assert [micro_batch(16384, p) for p in (2, 4)] == [2048, 1024]
    assert [micro_batch(4096, p) for p in (2, 4)] == [512, 256]
    assert micro_batch(1024, 2) == 256  # 4 micro-batches: the fewest kept (2 x P)
    assert micro_batch(512, 2) is None
    llama = get_model("llama-3.1-70b")
    base = [Shape(4), Shape(8)]
    assert pipelines(llama, base, 16384, 512) == [Shape(8, 1, 2, 2048), Shape(8, 1, 4, 1024)]
    assert pipelines(llama, base, 16384, 24) == [Shape(8, 1, 2, 2048)]  # the GPU budget
    assert pipelines(llama, base, 256, 512) == []


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Deployment("disagg", prefill_pp=0), "prefill_pp must be >= 1, got 0"),
        (lambda: Deployment("colocated", prefill_pp=2),
         "--prefill-pp 2 pipelines the prefill pool of --mode disagg"),
        (lambda: Deployment("disagg", prefill_pp_shared=True),
         "--prefill-pp-shared puts a prefill pipeline's stages on one stage's devices: add "
         "--prefill-pp N"),
        (lambda: tiny().latency(1, pp=5),
         "--prefill-pp 5 is more stages than tiny's 4 layers (each stage needs one): use at "
         "most 4"),
    ],
)  # fmt: skip
def test_impossible_pipelines_are_refused_with_what_to_do(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value)


SIM = ["simulate", "--model", "llama-3-8b", "--rate", "1", "--num-requests", "20",
       "--prompt-tokens", "4096", "--output-tokens", "8", "--mode", "disagg"]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill-pp", "33"], "--prefill-pp 33 is more stages than llama-3-8b's 32 layers"),
        (["--decode-pp", "2"], "--decode-pp 2: pipeline parallelism is for the prefill pool"),
    ],
)
def test_simulate_refuses_what_pdserve_serve_would(capsys, args, message):
    assert main([*SIM, *args]) == 2
    assert message in capsys.readouterr().err


def test_simulate_runs_a_prefill_pipeline(capsys):
    assert main([*SIM, "--prefill-pp", "2", "--chunk", "512", "--prefill-tp", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("disaggregated 1P x TP8 PP2 : 1D x TP1 (17 x h100-sxm)")
    assert main([*SIM, "--prefill-pp", "2", "--prefill-pp-shared", "--prefill-tp", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("disaggregated 1P x TP8 PP2 (shared) : 1D x TP1 (9 x h100-sxm)")


# Llama-3.1-70B on H100 nodes over IB NDR: 16k-token prompts, 128 tokens out, 1 req/s
PLAN = ["--model", "llama-3.1-70b", "--gpu", "h100", "--link", "ib-ndr", "--prompt-tokens",
        "16384", "--output-tokens", "128", "--rate", "1", "--slo-tpot", "0.05"]  # fmt: skip


def test_plan_pipelines_prefill_across_nodes_when_one_node_misses_the_ttft(capsys):
    # One TP8 node prefills a 16k-token prompt in 674 ms, past a 600 ms TTFT; four TP8 stages
    # take 268 ms.
    assert main(["plan", *PLAN, "--slo-ttft", "0.6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rec = out["recommendation"]
    assert (rec["label"], rec["num_gpus"]) == ("disaggregated 1P x TP8 PP4 : 1D x TP4", 36)
    assert rec["deployment"]["chunk"] == 1024
    assert ('--prefill-tp 8 --decode-tp 4 --prefill-pp 4 --prefill-args "--chunk-size 1024"'
            in out["serve_command"])  # fmt: skip
    [pipe] = [r for r in out["reasons"] if r.startswith("pipeline of 4 stages of 20 layers")]
    assert "in 16 micro-batches of 1,024 tokens takes 267.9 ms" in pipe
    assert "over ib-ndr (across nodes); one TP8 instance alone takes 673.8 ms" in pipe
    assert "no co-located deployment met the SLOs within the GPU budget" in out["reasons"]
    # the command it prints is one `pdserve serve` reads
    args = build_parser().parse_args(shlex.split(out["serve_command"])[1:])
    assert (args.prefill_pp, args.prefill_tp, args.decode_tp) == (4, 8, 4)


def test_plan_keeps_prefill_on_one_node_when_the_ttft_allows():
    from pdserve.bench.workload import LengthDist, Workload
    from pdserve.sim.planner import PlanRequest, plan

    cl = Cluster(get_model("llama-3.1-70b"), get_gpu("h100"), get_link("ib-ndr"))
    work = Workload.from_lengths(LengthDist.parse("16384"), LengthDist.parse("128"))
    found = plan(PlanRequest(cl, work, 1.0, SLO(2.0, 0.05))).feasible
    assert found[0].deployment.label == "co-located 2 x TP8, chunked prefill 1024"
    assert found[0].deployment.num_gpus == 16
    piped = [c for c in found if c.deployment.prefill_pp > 1]
    assert min(c.deployment.num_gpus for c in piped) == 20  # 1P x TP8 PP2 : 1D x TP4
