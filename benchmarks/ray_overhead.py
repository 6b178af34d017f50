"""What the Ray launcher costs against the local one: time from `pdserve serve` to `pdserve
ready` (Ray's includes starting a local cluster when no --ray-address is given), and TTFT and
ITL p50 of closed-loop chat streams at concurrency 1 and 8, one deployment (1 P + 1 D,
disaggregated) per launcher, the launchers taking turns for `--rounds` rounds so that the
machine's drift falls on both alike. Medians over rounds of each round's p50.

    .venv/bin/python benchmarks/ray_overhead.py [--rounds 2] [--duration 15]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _servers import median, pct  # noqa: E402
from servers import Server  # noqa: E402

from pdserve.bench.client import Endpoint, make_client, send_request  # noqa: E402
from pdserve.bench.prompts import load_prompt_builder  # noqa: E402
from pdserve.bench.workload import RequestSpec  # noqa: E402

LAUNCHERS = {"local": (), "ray": ("--launcher", "ray")}


async def run(url: str, concurrency: int, duration: float, builder) -> tuple[list, list, int]:
    """(TTFTs, inter-token intervals, failed requests) of `concurrency` chat streams."""
    ep = Endpoint(url, api="chat", timeout_s=600)
    ttfts, itls, failed = [], [], 0
    t0 = time.perf_counter()
    counter = iter(range(1_000_000))

    async def stream(client):
        nonlocal failed
        while time.perf_counter() < t0 + duration:
            spec = RequestSpec(next(counter), 0.0, "chat", 64, 64)
            rec = await send_request(client, ep, spec, builder.build(spec), t0)
            if rec.status == "ok":
                ttfts.append(rec.ttft_s)
                itls.extend(rec.itl_s)
            else:
                failed += 1

    async with make_client() as client:
        await asyncio.gather(*(stream(client) for _ in range(concurrency)))
    return ttfts, itls, failed


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per concurrency")
    ap.add_argument("--concurrency", default="1,8")
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    levels = [int(c) for c in args.concurrency.split(",")]
    builder = load_prompt_builder("bundled", seed=0)
    start = {n: [] for n in LAUNCHERS}
    p50 = {(n, c, k): [] for n in LAUNCHERS for c in levels for k in ("ttft", "itl")}
    failed = 0
    for r in range(args.rounds):
        for name, flags in LAUNCHERS.items():
            t0 = time.monotonic()
            with Server("--mode", "disagg", *flags) as server:
                start[name].append(time.monotonic() - t0)
                url = server.url + "/v1"
                asyncio.run(run(url, 2, 3, builder))  # warm-up
                for c in levels:
                    ttfts, itls, bad = asyncio.run(run(url, c, args.duration, builder))
                    p50[name, c, "ttft"].append(pct(ttfts, 50))
                    p50[name, c, "itl"].append(pct(itls, 50))
                    failed += bad
                    print(f"round {r + 1} {name} c={c}: TTFT p50 {pct(ttfts, 50) * 1e3:.0f} ms, "
                          f"ITL p50 {pct(itls, 50) * 1e3:.1f} ms, {len(ttfts)} requests",
                          flush=True)  # fmt: skip
    print(f"\n1 P + 1 D, chat 64/64 tokens, {args.rounds} rounds x {args.duration:g} s per level")
    print("| | local | ray | ray / local |\n|---|---|---|---|")
    a, b = median(start["local"]), median(start["ray"])
    print(f"| start-up to ready (s) | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    for c in levels:
        for k, unit in (("ttft", "ms"), ("itl", "ms")):
            a, b = median(p50["local", c, k]), median(p50["ray", c, k])
            print(f"| {k.upper()} p50 at c={c} ({unit}) | {a * 1e3:.1f} | {b * 1e3:.1f} | "
                  f"{b / a:.3f}x |")  # fmt: skip
    print(f"failed requests: {failed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
