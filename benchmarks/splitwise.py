"""Splitwise's question on the presets: is H100 prefill + A100 decode cheaper than one type?

For each workload shape the planner searches homogeneous H100, homogeneous A100 and the
H100 -> A100 mix (co-located and disaggregated, every TP) with --optimize cost, and the table
gives the cheapest feasible deployment of each kind: $ per hour at the target rate, $ per
million tokens at its estimated goodput. Prices are the presets' assumed list prices unless
--gpu-cost overrides them.

    python benchmarks/splitwise.py [--model llama-3.1-70b] [--gpu-cost h100=2.99,a100=1.79]
"""

from __future__ import annotations

import argparse

from pdserve.bench.metrics import SLO
from pdserve.bench.workload import LengthDist, Workload
from pdserve.sim.commands import cluster_of
from pdserve.sim.planner import PlanRequest, cost_per_million_tokens, plan

# (name, prompt, output, rate, TTFT s, TPOT s). Splitwise's two Azure traces: coding (median
# 1,500 prompt tokens, 13 output) and conversation (1,020 and 129); then two it does not cover.
CASES = (
    ("coding (Splitwise)", 1500, 13, 20.0, 1.0, 0.1),
    ("conversation (Splitwise)", 1020, 129, 10.0, 1.0, 0.1),
    ("decode-heavy", 256, 1024, 4.0, 1.0, 0.1),
    ("coding, tight TPOT", 1500, 13, 20.0, 1.0, 0.02),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--gpu-cost", help="e.g. h100=2.99,a100=1.79 (default: the presets')")
    ap.add_argument("--link", default="ib-ndr")
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    ns = argparse.Namespace(
        model=args.model, gpu="h100", profile=None, dtype="bf16", kv_dtype=None,
        link=args.link, bandwidth_gbps=None, prefill_gpu="h100,a100", decode_gpu="a100,h100",
        gpu_cost=args.gpu_cost, gpu_power=None, gpu_link=None, kv_compression="none",
    )  # fmt: skip
    cluster = cluster_of(ns)
    prices = ", ".join(f"{d.name} ${d.accel.cost_per_hour:g}/h" for d in cluster.devices.values())
    print(f"{args.model}, KV over {args.link}, --optimize cost; prices {prices}")
    print(f"{'workload':<26} {'kind':<16} {'deployment':<58} {'$/h':>7} {'$/Mtok':>7}")
    for name, prompt, output, rate, ttft, tpot in CASES:
        work = Workload.from_lengths(LengthDist.parse(str(prompt)), LengthDist.parse(str(output)))
        req = PlanRequest(cluster, work, rate, SLO(ttft, tpot), num_requests=args.requests,
                          objective="cost", prefill_gpus=("h100", "a100"),
                          decode_gpus=("a100", "h100"))  # fmt: skip
        feasible = plan(req).feasible
        kinds = {
            "mixed": [c for c in feasible if c.deployment.heterogeneous],
            "h100 only": [c for c in feasible if _only(c, cluster, "h100-sxm")],
            "a100 only": [c for c in feasible if _only(c, cluster, "a100-80gb")],
        }
        label = f"{name} {prompt}/{output} @{rate:g}/s TPOT {tpot * 1e3:g}ms"
        print(label)
        for kind, cands in kinds.items():
            if not cands:
                print(f"{'':<26} {kind:<16} {'(none meets the SLOs)':<58}")
                continue
            c = cands[0]
            print(f"{'':<26} {kind:<16} {c.deployment.label:<58} "
                  f"{c.deployment.cost_per_hour(cluster):>7.2f} "
                  f"{cost_per_million_tokens(c, req):>7.3f}")  # fmt: skip


def _only(c, cluster, name: str) -> bool:
    return set(c.deployment.gpus_by_device(cluster)) == {name}


if __name__ == "__main__":
    main()
