"""Heterogeneous pools (Splitwise) in the planner and simulator: per-pool hardware, prices and
power, the slower end's KV link, and `pdserve plan --optimize cost` choosing the mix exactly
when it is cheapest."""

import json

import pytest

from pdserve.bench.metrics import SLO
from pdserve.bench.workload import LengthDist, Workload, generate_requests
from pdserve.cli import main
from pdserve.sim.deployment import Cluster, Deployment, Device
from pdserve.sim.hardware import Accelerator, Link, get_link, parse_figures
from pdserve.sim.latency import Efficiency
from pdserve.sim.models import get_model
from pdserve.sim.planner import PlanRequest, plan
from pdserve.sim.report import plan_text
from pdserve.sim.simulator import simulate

MODEL = get_model("smollm2-135m")
EFF = Efficiency(half_tokens=0.0)  # a plain roofline: small batches are bandwidth-bound
LINK = get_link("ib-ndr")
# Two hand-made devices of one node each (max_tp 1): "fast" has 10x the FLOP/s of "cheap" and
# the same memory bandwidth, so a 2,000-token prefill takes ~0.1 s on fast and ~1 s on
# cheap, while a decode step (bandwidth-bound: ~3.6 ms of weights + 2 ms overhead) is the
# same on both.
FAST = Accelerator("fast", "compute-rich", 10e12, 100e9, 80e9, "pcie-gen4", 1, 3.0, 700)
CHEAP = Accelerator("cheap", "memory-rich", 1e12, 100e9, 80e9, "pcie-gen4", 1, 1.0, 400)
# Long prompts, short outputs (Splitwise's coding trace: ~1,500 in, ~13 out).
WORKLOAD = Workload.from_lengths(LengthDist.parse("2000"), LengthDist.parse("8"))
# TTFT 0.4 s: no prefill on cheap can meet it. TPOT 8 ms: a pure decode step (~6 ms) meets
# it on either device, but a step carrying even a 256-token prefill chunk (~11 ms on fast)
# does not, so co-located serving meets it only with so many instances that prefills rarely
# land among a request's decode steps.
SLOS = SLO(0.4, 0.008)


def cluster(decode_price: float = 1.0, cheap_link: Link = LINK) -> Cluster:
    cheap = Accelerator(**{**CHEAP.__dict__, "cost_per_hour": decode_price})
    devices = {
        "fast": Device(FAST, EFF, "bf16", LINK),
        "cheap": Device(cheap, EFF, "bf16", cheap_link),
    }
    return Cluster(MODEL, FAST, LINK, EFF, devices=devices)


def request(cl: Cluster, objective: str = "cost") -> PlanRequest:
    return PlanRequest(cl, WORKLOAD, 5.0, SLOS, num_requests=60, objective=objective,
                       prefill_gpus=("fast", "cheap"), decode_gpus=("fast", "cheap"))  # fmt: skip


def test_the_mix_is_cheapest_when_prefill_needs_flops_and_decode_only_bandwidth():
    # fast:fast costs 2 x $3; fast prefill + cheap decode $3 + $1; nothing on cheap prefills
    # within 0.4 s, and co-located needs many fast instances to keep prefills out of TPOT.
    req = request(cluster())
    result = plan(req)
    best = result.feasible[0].deployment
    assert (best.mode, best.prefill_gpu, best.decode_gpu) == ("disagg", "fast", "cheap")
    assert (best.num_prefill, best.num_decode) == (1, 1)
    assert best.cost_per_hour(req.cluster) == pytest.approx(4.0)
    assert best.gpus_by_device(req.cluster) == {"fast": 1, "cheap": 1}
    assert best.power_w(req.cluster) == 1100
    colocated = [c for c in result.feasible if c.deployment.mode == "colocated"]
    assert min(c.deployment.cost_per_hour(req.cluster) for c in colocated) >= 6 * 3.0
    text = plan_text(req, result)
    assert "mixed hardware (disaggregated 1P x TP1 on fast : 1D x TP1 on cheap" in text
    assert "mixed wins on cost" in text
    # Fewest GPUs is a tie (2 either way) broken by goodput per GPU, not by price.
    by_gpus = plan(request(cluster(), "gpus")).feasible[0].deployment
    assert by_gpus.num_gpus == 2


def test_the_mix_is_not_chosen_when_its_decode_device_costs_more():
    req = request(cluster(decode_price=3.5))
    result = plan(req)
    best = result.feasible[0].deployment
    assert (best.mode, best.prefill_gpu, best.decode_gpu) == ("disagg", "fast", "fast")
    assert best.cost_per_hour(req.cluster) == pytest.approx(6.0)
    mixed = [c for c in result.feasible if c.deployment.heterogeneous]
    assert mixed and mixed[0].deployment.cost_per_hour(req.cluster) == pytest.approx(6.5)
    assert "single-hardware wins on cost" in plan_text(req, result)


def test_kv_between_two_devices_moves_at_the_slower_ends_link():
    slow = Link.from_gbps(1.0)  # 125 MB/s: a 2,000-token prompt's 7.4 MB KV takes ~59 ms
    reqs = generate_requests(WORKLOAD, 20, 0, rate=1.0)
    dep = Deployment("disagg", prefill_gpu="fast", decode_gpu="cheap")
    ttft = {
        name: simulate(cl, dep, reqs, SLOS).aggregates["ttft_s"]["p50"]
        for name, cl in (("fast link", cluster()), ("slow decode end", cluster(1.0, slow)))
    }
    kv_s = MODEL.num_layers * 2 * MODEL.num_kv_heads * MODEL.head_dim * 2 * 2000 / 125e6
    # The body streams while the prefill computes; on a slow link the rest waits for it.
    assert ttft["slow decode end"] - ttft["fast link"] > 0.5 * kv_s


def test_price_and_power_flags_parse_and_refuse_what_is_malformed():
    assert parse_figures("h100=4.5, a100-80gb=2.1", "--gpu-cost") == {
        "h100-sxm": 4.5, "a100-80gb": 2.1}  # fmt: skip
    for bad in ("h100", "h100=cheap", "=3", "h100=-1"):
        with pytest.raises(ValueError, match="is not DEVICE=NUMBER"):
            parse_figures(bad, "--gpu-cost")
    unpriced = Cluster(MODEL, FAST, LINK, devices={"x": Device(
        Accelerator("x", "no price", 1e12, 1e11, 8e10), EFF, "bf16", LINK)})  # fmt: skip
    with pytest.raises(ValueError, match="--optimize cost needs a figure for x: give --gpu-cost"):
        PlanRequest(unpriced, WORKLOAD, 1.0, SLOS, objective="cost", prefill_gpus=("x",))


PLAN = ["plan", "--model", "smollm2-135m", "--prefill-gpu", "h100", "--decode-gpu", "a100",
        "--prompt-tokens", "2000", "--output-tokens", "16", "--rate", "8", "--slo-ttft", "0.5",
        "--slo-tpot", "0.03", "--requests", "40", "--json"]  # fmt: skip


def test_plan_optimize_cost_end_to_end(capsys):
    code = main([*PLAN, "--optimize", "cost", "--gpu-cost", "h100=3,a100=1", "--top", "50"])
    out = json.loads(capsys.readouterr().out)
    rec = out["recommendation"]
    assert (code, out["objective"], out["devices"]) == (0, "cost", ["h100-sxm", "a100-80gb"])
    # The overridden prices are what is summed, and nothing feasible is cheaper.
    by = rec["gpus_by_device"]
    assert rec["cost_per_hour"] == pytest.approx(3 * by.get("h100-sxm", 0)
                                                 + by.get("a100-80gb", 0))  # fmt: skip
    assert all(rec["cost_per_hour"] <= c["cost_per_hour"] for c in out["runner_ups"])
    assert rec["cost_per_million_tokens"] > 0 and rec["goodput_per_dollar"] > 0
    # Homogeneous deployments of each type and the H100 -> A100 mix were all searched.
    searched = {(c["deployment"]["mode"], c["deployment"]["gpu"], c["deployment"]["prefill_gpu"],
                 c["deployment"]["decode_gpu"]) for c in [rec, *out["runner_ups"]]}  # fmt: skip
    assert {("colocated", "h100", None, None), ("colocated", "a100", None, None),
            ("disagg", None, "h100", "a100")} <= searched  # fmt: skip
    assert any(r.startswith("mixed hardware (") for r in out["reasons"])
    assert "-ep" not in out["serve_command"]  # a dense model: no expert parallelism


def test_plan_refuses_an_unknown_device_and_a_list_in_simulate(capsys):
    assert main([*PLAN[:4], "tpu-v9", *PLAN[5:]]) == 2
    assert "unknown GPU 'tpu-v9'" in capsys.readouterr().err
    assert main(["simulate", "--model", "llama-3.1-8b", "--mode", "disagg", "--prefill-gpu",
                 "h100,a100", "--rate", "1"]) == 2  # fmt: skip
    assert "give one --prefill-gpu" in capsys.readouterr().err
    assert main([*PLAN, "--gpu-cost", "tpu=9"]) == 2
    assert "--gpu-cost names tpu, which no pool runs on" in capsys.readouterr().err
    assert main(["simulate", "--model", "mixtral-8x7b", "--decode-ep", "2", "--rate", "1"]) == 2
    assert "lay out the pools of --mode disagg" in capsys.readouterr().err


def test_a_grown_pool_keeps_its_own_hardware():
    from pdserve.sim.scaling import simulate_scaled

    reqs = generate_requests(WORKLOAD, 40, 0, rate=4.0)
    dep = Deployment("disagg", prefill_gpu="fast", decode_gpu="cheap", decode_ep=1)
    scaled = simulate_scaled(cluster(), dep, reqs, SLOS, lambda obs, now: (2, 3), 1.0, 0.5)
    made = {(x.pool, x.inst.lat.accel.name) for x in scaled.leases}
    assert made == {("prefill", "fast"), ("decode", "cheap")}
    assert sum(x.pool == "decode" for x in scaled.leases) == 3


def test_optimize_power_weighs_watts():
    # 700 W + 400 W for the mix against 2 x 700 W on fast alone.
    req = request(cluster(), "power")
    best = plan(req).feasible[0].deployment
    assert (best.prefill_gpu, best.decode_gpu, best.power_w(req.cluster)) == ("fast", "cheap", 1100)
