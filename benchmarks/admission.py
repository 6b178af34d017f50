"""SLO-aware admission control under 3x the sustainable load, measured on this machine.

1. Finds the sustainable load: `pdserve serve` without SLO admission, one open-loop Poisson run
   per rate of --sweep; goodput = the highest rate with >= 90 % of requests within the SLOs
   (DistServe's definition, as `pdserve bench --sweep`).
2. Offers --overload x that rate for --duration seconds, side by side: the same server without
   admission control, then with `--slo-ttft/--slo-tpot` (429 + Retry-After for the excess).
Prints, per run: requests sent, completed, refused with 429 (and how many carried Retry-After),
other errors, and TTFT / TPOT p50 and p99 of the admitted requests against the SLO.

    .venv/bin/python benchmarks/admission.py [--mode disagg] [--workload chat]
        [--slo-ttft 2] [--slo-tpot 0.2] [--sweep 0.5,1,1.5,2,3] [--duration 60] [--overload 3]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _servers import server  # noqa: E402

from pdserve.bench.client import Endpoint  # noqa: E402
from pdserve.bench.metrics import SLO  # noqa: E402
from pdserve.bench.prompts import load_prompt_builder  # noqa: E402
from pdserve.bench.report import ms  # noqa: E402
from pdserve.bench.runner import LoadConfig, parse_rates, run_load, run_sweep  # noqa: E402
from pdserve.bench.workload import generate_requests, named_workload  # noqa: E402


def summary(label: str, rate: float, run, slo: SLO) -> dict:
    records = run.records
    ok = [r for r in records if r.ok]
    refused = [r for r in records if r.error and r.error.startswith("HTTP 429")]
    agg = run.aggregates
    return {
        "run": label,
        "rate": rate,
        "sent": len(records),
        "completed": len(ok),
        "refused_429": len(refused),
        "with_retry_after": sum("Retry-After" in r.error for r in refused),
        "other_errors": len(records) - len(ok) - len(refused),
        "ttft_p50": agg["ttft_s"]["p50"],
        "ttft_p99": agg["ttft_s"]["p99"],
        "tpot_p50": agg["tpot_s"]["p50"],
        "tpot_p99": agg["tpot_s"]["p99"],
        "admitted_in_slo": sum(slo.meets(r) for r in ok) / len(ok) if ok else None,
        "goodput": sum(slo.meets(r) for r in ok) / run.duration_s,
        "requests": [  # start (s from the run's start), status, TTFT, TPOT
            [round(r.start_s, 3), r.status if r.ok else (r.error or "")[:8], r.ttft_s, r.tpot_s]
            for r in records
        ],
    }


def table(rows: list[dict], slo: SLO) -> str:
    head = (
        f"{'run':<26} {'rate':>5} {'sent':>5} {'ok':>5} {'429':>5} {'R-A':>5} {'err':>4} "
        f"{'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>6} {'in SLO':>7} {'good/s':>7}"
    )
    lines = [
        f"SLO: TTFT <= {slo.ttft_s * 1000:.0f} ms, TPOT <= {slo.tpot_s * 1000:.0f} ms "
        "(latencies of admitted requests, ms)",
        head,
    ]
    for r in rows:
        share = "-" if r["admitted_in_slo"] is None else f"{r['admitted_in_slo']:.0%}"
        lines.append(
            f"{r['run']:<26} {r['rate']:>5.2f} {r['sent']:>5} {r['completed']:>5} "
            f"{r['refused_429']:>5} {r['with_retry_after']:>5} {r['other_errors']:>4} "
            f"{ms(r['ttft_p50']):>9} {ms(r['ttft_p99']):>7} {ms(r['tpot_p50']):>9} "
            f"{ms(r['tpot_p99']):>6} {share:>7} {r['goodput']:>7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    p.add_argument("--workload", default="chat", help="a named bench workload (default chat)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds (default 2)")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="seconds (default 0.2)")
    p.add_argument("--sweep", default="0.5,1,1.5,2,3", help="rates to find goodput over")
    p.add_argument("--sustainable", type=float, default=None, help="skip the sweep: this rate")
    p.add_argument("--sweep-duration", type=float, default=40.0, help="seconds per sweep rate")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of overload per run")
    p.add_argument("--overload", type=float, default=3.0, help="multiple of the sustainable rate")
    p.add_argument(
        "--runs",
        choices=["both", "on", "off"],
        default="both",
        help="overload runs: without admission, with it, or both (default)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = p.parse_args(argv)

    slo = SLO(args.slo_ttft, args.slo_tpot, None)
    workload = named_workload(args.workload)
    factory = lambda *a: generate_requests(workload, *a)  # noqa: E731
    prompts = load_prompt_builder("bundled", args.seed)
    rows = []

    def overload_run(url: str, label: str, rate: float) -> None:
        load = LoadConfig("poisson", rate, duration_s=args.duration, seed=args.seed + 1)
        run = run_load(Endpoint(url, timeout_s=600), factory, prompts, load, slo, label)
        rows.append(summary(label, rate, run, slo))

    with server(args.mode) as url:
        sustainable = args.sustainable
        if sustainable is None:
            load = LoadConfig("poisson", 1.0, duration_s=args.sweep_duration, seed=args.seed)
            ep = Endpoint(url, timeout_s=600)
            sweep = run_sweep(ep, factory, prompts, load, slo, parse_rates(args.sweep))
            for run in sweep.runs:
                rows.append(summary("sweep (no admission)", run.load.rate, run, slo))
            print(table(rows, slo), flush=True)
            if sweep.goodput is None:
                print("even the lowest rate misses the SLOs: lower --sweep or relax them")
                return 1
            sustainable = sweep.goodput
        rate = sustainable * args.overload
        if args.runs != "on":
            overload_run(url, f"{args.overload:g}x, admission off", rate)
    extra = ("--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot))
    if args.runs != "off":
        with server(args.mode, *extra) as url:
            overload_run(url, f"{args.overload:g}x, admission on", rate)
            text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
            reasons = re.findall(r'^pdserve_rejected_total\{reason="(\w+)"\} (\S+)$', text, re.M)
            rows[-1]["refused_by"] = {k: int(float(v)) for k, v in reasons}
    print(f"\nmode {args.mode}, workload {args.workload}; sustainable rate {sustainable:g}/s")
    print(table(rows, slo))
    if rows[-1].get("refused_by"):
        print(f"429 by reason (admission on): {rows[-1]['refused_by']}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
