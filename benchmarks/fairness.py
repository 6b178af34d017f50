"""Fair admission under overload, measured: a light tenant's goodput alone, and while a heavy
tenant sends 10x its rate (far beyond what the server serves).

`pdserve serve --mode colocated --max-inflight 4` (both cores, one worker); the tenants are told
apart by the `user` field. Poisson arrivals, chat prompts of 64 tokens, 64 output tokens. Three
phases of `--duration` seconds: light alone; light + heavy as two tenants (fair turns at
capacity); light + heavy as one tenant (the same `user`: first come, first served, what the
router did before tenants). Goodput: requests per second that completed with TTFT <= --slo-ttft.

    .venv/bin/python benchmarks/fairness.py [--light-rate 0.5] [--duration 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _servers import server  # noqa: E402

from pdserve.bench.client import Endpoint, make_client, send_request  # noqa: E402
from pdserve.bench.prompts import load_prompt_builder  # noqa: E402
from pdserve.bench.workload import RequestSpec  # noqa: E402


async def tenant(client, url, user, rate, args, builder, seed, records):
    ep = Endpoint(url, timeout_s=600, extra_body=json.dumps({"user": user}))
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    at, tasks, i = 0.0, [], 0
    while True:
        at += rng.exponential(1 / rate)
        if at > args.duration:
            break
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        spec = RequestSpec(seed * 1_000_000 + i, at, "chat", 64, 64)
        i += 1
        tasks.append(asyncio.create_task(send_request(client, ep, spec, builder.build(spec), t0)))
    records += await asyncio.gather(*tasks)


def goodput(records, args) -> tuple[float, int, int]:
    good = [r for r in records if r.status == "ok" and r.ttft_s <= args.slo_ttft]
    return len(good) / args.duration, len(records), sum(r.status != "ok" for r in records)


async def phase(url, args, builder, heavy_user):
    light, heavy = [], []
    async with make_client() as client:
        jobs = [tenant(client, url, "light", args.light_rate, args, builder, 1, light)]
        if heavy_user:
            rate = args.light_rate * args.flood
            jobs.append(tenant(client, url, heavy_user, rate, args, builder, 2, heavy))
        await asyncio.gather(*jobs)
    return goodput(light, args), goodput(heavy, args) if heavy_user else None


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--light-rate", type=float, default=0.5, help="light tenant, requests/s")
    ap.add_argument("--flood", type=float, default=10.0, help="heavy tenant's rate / light's")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per phase")
    ap.add_argument("--slo-ttft", type=float, default=10.0, help="goodput counts TTFT <= this")
    ap.add_argument("--max-inflight", type=int, default=4)
    args = ap.parse_args()
    builder = load_prompt_builder("bundled", seed=0)
    flags = ("--max-inflight", str(args.max_inflight), "--queue-timeout", "20")
    rows = []
    with server("colocated", *flags) as url:
        for name, heavy_user in (
            ("light alone", None),
            ("light + 10x heavy, two tenants", "heavy"),
            ("light + 10x heavy, one tenant", "light"),
        ):
            light, heavy = asyncio.run(phase(url, args, builder, heavy_user))
            rows.append((name, light, heavy))
            print(f"{name}: light {light}, heavy {heavy}", flush=True)
    base = rows[0][1][0]
    print(f"\nmax-inflight {args.max_inflight}, light {args.light_rate:g} req/s, heavy "
          f"{args.flood:g}x, {args.duration:g} s per phase, "
          f"goodput = TTFT <= {args.slo_ttft:g} s")  # fmt: skip
    print(f"{'phase':<34} {'light goodput':>14} {'vs alone':>9} {'light sent/failed':>18} "
          f"{'heavy goodput':>14} {'heavy sent/failed':>18}")  # fmt: skip
    for name, (lg, ls, lf), heavy in rows:
        hg = f"{heavy[0]:.2f}/s" if heavy else "-"
        hs = f"{heavy[1]}/{heavy[2]}" if heavy else "-"
        print(f"{name:<34} {lg:>12.2f}/s {lg / base:>8.2f}x {f'{ls}/{lf}':>18} {hg:>14} {hs:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
