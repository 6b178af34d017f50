"""The autoscaler over a simulated day at GPU scale: GPU-hours and SLO attainment.

Replays one day-shaped trace through the simulator (`pdserve.sim.scaling`) on a GPU cluster
(default: Llama-3.1-70B on H100 SXM, TP 4 per prefill and per decode instance, InfiniBand NDR
between them) three ways:

1. static, sized for the peak rate (the autoscaler's own search, `Autoscaler.decide`, run on
   --size-horizon seconds of load at that rate);
2. static, sized the same way for the mean rate;
3. the autoscaler (`pdserve.sim.autoscale.Autoscaler`), deciding every --interval seconds with
   the SLO targets, --headroom, --cooldown and bounds from 1P+1D to --max-prefill/--max-decode;
   an added instance serves --startup seconds after it is asked for (model load and warm-up),
   a removed one drains. It starts sized for the trace's first rate.

The day: Poisson arrivals whose rate rises from --peak-rate / 10 to --peak-rate and back (a
cosine), compressed into --hours of simulated time, plus a burst: x --burst-factor for
--burst-minutes at --burst-at of the day. Lengths: --prompt-tokens / --output-tokens (bench's
syntax), or a named --workload. Device-hours count every instance from its start to the end of
its drain, x its TP degree. Prints a table, writes autoscale.json and autoscale.png to --out.

    .venv/bin/python benchmarks/autoscale.py [--hours 2] [--peak-rate 60] [--out docs/results]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from pdserve.bench.metrics import SLO
from pdserve.bench.workload import LengthDist, RequestSpec, Workload, generate_requests
from pdserve.bench.workload import named_workload as get_workload
from pdserve.sim.autoscale import Autoscaler, Decision, Observation, ScaleBounds, ScalePolicy
from pdserve.sim.deployment import Cluster, Deployment
from pdserve.sim.hardware import get_gpu, get_link
from pdserve.sim.models import get_model
from pdserve.sim.scaling import ScaledResult, controlled_by, simulate_scaled

WINDOW_S = 300.0  # attainment per window of arrivals, for the plot
SIZING_MAX = 64  # instances per pool the static sizing may choose


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="llama-3.1-70b", help="a pdserve.sim.models preset")
    ap.add_argument("--gpu", default="h100", help="a pdserve.sim.hardware preset")
    ap.add_argument("--link", default="ib-ndr", help="KV link between instances")
    ap.add_argument("--tp", type=int, default=4, help="TP degree of every instance")
    ap.add_argument("--prompt-tokens", default="uniform:1024,3072", help="length distribution")
    ap.add_argument("--output-tokens", default="uniform:128,512", help="length distribution")
    ap.add_argument("--workload", help="a named workload instead of the two lengths")
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.04, help="seconds")
    ap.add_argument("--hours", type=float, default=2.0, help="simulated length of the day")
    ap.add_argument("--peak-rate", type=float, default=60.0, help="requests/s at midday")
    ap.add_argument("--burst-at", type=float, default=0.25, help="share of the day")
    ap.add_argument("--burst-factor", type=float, default=1.3)
    ap.add_argument("--burst-minutes", type=float, default=5.0)
    ap.add_argument("--interval", type=float, default=60.0, help="seconds between decisions")
    ap.add_argument("--cooldown", type=float, default=60.0, help="seconds before a pool shrinks")
    ap.add_argument("--startup", type=float, default=60.0, help="seconds until a new one serves")
    ap.add_argument("--headroom", type=float, default=0.7, help="plan p90s at this x SLO")
    ap.add_argument("--horizon", type=float, default=60.0, help="seconds each prediction runs")
    ap.add_argument("--max-sim-requests", type=int, default=1500, help="... at most")
    ap.add_argument("--max-prefill", type=int, default=14)
    ap.add_argument("--max-decode", type=int, default=6)
    ap.add_argument("--size-horizon", type=float, default=300.0, help="static sizing's seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results")
    return ap.parse_args()


def day_rate(t: np.ndarray, args) -> np.ndarray:
    """Arrivals/s at `t` seconds: trough -> peak -> trough, times the burst inside it."""
    day, trough = args.hours * 3600, args.peak_rate / 10
    rate = trough + (args.peak_rate - trough) * (1 - np.cos(2 * np.pi * t / day)) / 2
    start = args.burst_at * day
    burst = (t >= start) & (t < start + args.burst_minutes * 60)
    return np.where(burst, rate * args.burst_factor, rate)


def day_trace(workload: Workload, args) -> list[RequestSpec]:
    """Poisson arrivals at `day_rate` (inverting its integral), lengths from `workload`."""
    grid = np.arange(0.0, args.hours * 3600 + 1)
    rate = day_rate(grid, args)
    expected = np.concatenate(([0.0], np.cumsum((rate[1:] + rate[:-1]) / 2)))  # per 1 s step
    rng = np.random.default_rng([args.seed, 2])
    n = int(rng.poisson(expected[-1]))
    times = np.interp(np.sort(rng.uniform(0, expected[-1], n)), expected, grid)
    lengths = generate_requests(workload, n, args.seed)
    return [r._replace(arrival_s=float(t)) for r, t in zip(lengths, times, strict=True)]


def size_for(scaler: Autoscaler, workload: Workload, rate: float, args) -> tuple[int, int]:
    """The autoscaler's cheapest counts for `rate`, predicted on --size-horizon s of load."""
    n = max(1, round(rate * args.size_horizon))
    sample = generate_requests(workload, n, args.seed + 1)
    wide = ScaleBounds(1, SIZING_MAX, 1, SIZING_MAX)  # a static deployment has no --max-*
    policy = replace(scaler.policy, bounds=wide, horizon_s=args.size_horizon, max_sim_requests=n)
    fresh = Autoscaler(scaler.cluster, scaler.base, policy, args.seed)
    lengths = [(r.prompt_tokens, r.output_tokens) for r in sample]
    return fresh.decide(Observation(n / rate, lengths, 1, 1), 0.0).target


def summary(label: str, run: ScaledResult, slo: SLO, args, events: int | None = None) -> dict:
    agg, records = run.result.aggregates, run.result.records
    tp = args.tp
    gpus = [(s.prefill + s.decode) * tp for s in run.series]
    windows = {}
    for r in records:
        w = windows.setdefault(int(r.arrival_s // WINDOW_S), [0, 0])
        w[0] += 1
        w[1] += slo.meets(r)
    return {
        "deployment": label,
        "gpu_hours": run.device_s / 3600,
        "gpus_min": min(gpus, default=0),
        "gpus_max": max(gpus, default=0),
        "slo_attainment": agg["slo_attainment"],
        "ttft_p90_s": agg["ttft_s"]["p90"],
        "tpot_p90_s": agg["tpot_s"]["p90"],
        "scale_events": events,
        "instances_started": sum(lease.started > 0 for lease in run.leases),
        "utilization": run.result.utilization,
        "attainment_per_window": [[k * WINDOW_S, ok / n] for k, (n, ok) in sorted(windows.items())],
    }


def print_table(rows: list[dict]) -> None:
    peak = rows[0]["gpu_hours"]
    print(f"\n{'deployment':<26} {'GPUs':>7} {'GPU-hours':>10} {'vs peak':>8} {'attainment':>11} "
          f"{'TTFT p90':>9} {'TPOT p90':>9}  scale events")  # fmt: skip
    for r in rows:
        lo, hi = r["gpus_min"], r["gpus_max"]
        gpus = f"{lo}" if lo == hi else f"{lo}-{hi}"
        events = "-"
        if r["scale_events"] is not None:
            events = f"{r['scale_events']} ({r['instances_started']} instances started)"
        print(f"{r['deployment']:<26} {gpus:>7} {r['gpu_hours']:>10.1f} "
              f"{r['gpu_hours'] / peak:>8.2f} {r['slo_attainment']:>11.3f} "
              f"{r['ttft_p90_s']:>7.2f} s {r['tpot_p90_s'] * 1e3:>6.1f} ms  {events}")  # fmt: skip


def plot(out: Path, args, autoscaled: ScaledResult, rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax_rate, ax_n, ax_att) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    minutes = np.arange(0, args.hours * 60 + 1)
    ax_rate.plot(minutes, day_rate(minutes * 60, args), color="gray", label="trace rate")
    series = autoscaled.series
    t = [s.time_s / 60 for s in series]
    ax_rate.plot(t, [s.rate for s in series], ".", ms=3, label="observed per interval")
    ax_rate.set_ylabel("requests/s")
    ax_rate.legend(loc="upper left")
    ax_n.step(t, [s.prefill for s in series], where="post", label="autoscaler: prefill")
    ax_n.step(t, [s.decode for s in series], where="post", label="autoscaler: decode")
    ax_n.set_ylabel(f"instances (TP {args.tp})")
    ax_n.legend(loc="upper left")
    for r in rows:
        pts = np.array(r["attainment_per_window"])
        ax_att.plot(pts[:, 0] / 60 + WINDOW_S / 120, pts[:, 1], marker=".", label=r["deployment"])
    ax_att.set_ylabel(f"SLO attainment per {WINDOW_S / 60:.0f} min")
    ax_att.set_xlabel("minutes of the simulated day")
    ax_att.legend(loc="lower right")
    fig.savefig(out / "autoscale.png", dpi=100, bbox_inches="tight")
    print(f"plot: {out / 'autoscale.png'}")


def changes(run: ScaledResult, decisions: list[Decision], start: tuple[int, int]) -> list[dict]:
    """The autoscaler's decisions that changed the pools, with their reasons."""
    after = [(s.prefill, s.decode) for s in run.series]
    before = [start, *after[:-1]]
    return [{"time_s": s.time_s, "before": b, "after": a, "reasons": list(dc.reasons)}
            for s, dc, b, a in zip(run.series, decisions, before, after, strict=True)
            if a != b]  # fmt: skip


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workload = Workload.from_lengths(
        LengthDist.parse(args.prompt_tokens), LengthDist.parse(args.output_tokens), "day"
    )
    if args.workload:
        workload = get_workload(args.workload)
    cluster = Cluster(get_model(args.model), get_gpu(args.gpu), get_link(args.link))
    slo = SLO(args.slo_ttft, args.slo_tpot)
    base = Deployment("disagg", prefill_tp=args.tp, decode_tp=args.tp)
    bounds = ScaleBounds(1, args.max_prefill, 1, args.max_decode)
    policy = ScalePolicy(slo, bounds, args.interval, args.cooldown, args.headroom, args.horizon,
                         args.max_sim_requests)  # fmt: skip
    scaler = Autoscaler(cluster, base, policy, args.seed)
    t0 = time.process_time()
    requests = day_trace(workload, args)
    rates = day_rate(np.arange(0.0, args.hours * 3600 + 1), args)
    print(f"{len(requests)} requests over {args.hours:g} h; rate {rates.min():.1f}-"
          f"{rates.max():.1f}/s (mean {rates.mean():.1f}); {args.model} on {args.gpu}, TP "
          f"{args.tp}; SLO TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s * 1e3:g} ms")  # fmt: skip
    targets = {"peak": rates.max(), "mean": rates.mean(), "start": rates[0]}
    sizes = {key: size_for(scaler, workload, rate, args) for key, rate in targets.items()}
    rows = []
    for key in ("peak", "mean"):
        dep = replace(base, num_prefill=sizes[key][0], num_decode=sizes[key][1])
        run = simulate_scaled(cluster, dep, requests, slo, None, args.interval)
        rows.append(summary(f"static, {key} ({dep.num_prefill}P+{dep.num_decode}D)", run, slo,
                            args))  # fmt: skip
    decisions: list[Decision] = []
    start = replace(base, num_prefill=sizes["start"][0], num_decode=sizes["start"][1])
    auto = simulate_scaled(cluster, start, requests, slo, controlled_by(scaler, decisions),
                           args.interval, args.startup)  # fmt: skip
    changed = changes(auto, decisions, sizes["start"])
    rows.append(summary("autoscaler", auto, slo, args, len(changed)))
    print_table(rows)
    print(f"({time.process_time() - t0:.0f} s of CPU)")
    report = {"args": vars(args), "sizes": sizes, "runs": rows,
              "series": [s._asdict() for s in auto.series], "changes": changed}  # fmt: skip
    (out / "autoscale.json").write_text(json.dumps(report, indent=1))
    print(f"results: {out / 'autoscale.json'}")
    plot(out, args, auto, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
