"""Prefill-decode interference, the seeds' central claim, measured on this machine.

8 chat streams decode continuously (closed loop) while 2,000-token documents arrive every few
seconds. Run in three deployments on the same two cores: co-located (one engine, both cores),
co-located + chunked prefill, and disaggregated (prefill worker on one core, decode worker on the
other). Prints the chat streams' inter-token latency p50/p99/max and the documents' TTFT.

    .venv/bin/python benchmarks/interference.py [--duration 40] [--doc-interval 6]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _servers import median, pct, server  # noqa: E402

from pdserve.bench.client import Endpoint, make_client, send_request  # noqa: E402
from pdserve.bench.prompts import load_prompt_builder  # noqa: E402
from pdserve.bench.workload import RequestSpec  # noqa: E402

MODES = {
    "colocated": ("colocated",),
    "colocated+chunked": ("colocated", "--chunk-size", "256"),
    "disagg": ("disagg",),
}


async def load(url: str, args, builder) -> tuple[list[float], list[float], int]:
    """Chat ITLs, document TTFTs, and the count of failed requests."""
    ep = Endpoint(url, timeout_s=600)
    itls, doc_ttfts, failures = [], [], 0
    t0 = time.perf_counter()
    stop_at = t0 + args.duration
    counter = iter(range(1_000_000))

    async def chat(client):
        nonlocal failures
        while time.perf_counter() < stop_at:
            spec = RequestSpec(next(counter), 0.0, "chat", args.chat_tokens, args.chat_output)
            rec = await send_request(client, ep, spec, builder.build(spec), t0)
            if rec.status != "ok":
                failures += 1
            else:  # every interval counts: a stream stalled by a prefill is the point
                itls.extend(rec.itl_s)

    async def docs(client):
        nonlocal failures
        await asyncio.sleep(args.warmup)
        pending = []
        while time.perf_counter() < stop_at - args.doc_interval / 2:
            spec = RequestSpec(next(counter), 0.0, "doc", args.doc_tokens, 4)
            pending.append(
                asyncio.create_task(send_request(client, ep, spec, builder.build(spec), t0))
            )
            await asyncio.sleep(args.doc_interval)
        for rec in await asyncio.gather(*pending):
            if rec.status == "ok":
                doc_ttfts.append(rec.ttft_s)
            else:
                failures += 1

    async with make_client() as client:
        await asyncio.gather(docs(client), *(chat(client) for _ in range(args.streams)))
    return itls, doc_ttfts, failures


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of load per mode")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring")
    ap.add_argument("--streams", type=int, default=8, help="concurrent chat streams")
    ap.add_argument("--chat-tokens", type=int, default=64)
    ap.add_argument("--chat-output", type=int, default=48)
    ap.add_argument("--doc-tokens", type=int, default=2000)
    ap.add_argument("--doc-interval", type=float, default=6.0, help="seconds between documents")
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    builder = load_prompt_builder("bundled", seed=0)
    rows = []
    for mode in args.modes.split(","):
        with server(mode, *MODES[mode][1:]) as url:
            itls, ttfts, failures = asyncio.run(load(url, args, builder))
        rows.append((mode, itls, ttfts, failures))
        print(
            f"{mode}: {len(itls)} chat intervals, {len(ttfts)} documents, {failures} failed",
            flush=True,
        )
    print(
        f"\n{'mode':<18} {'ITL p50':>9} {'ITL p99':>9} {'ITL max':>9} "
        f"{'doc TTFT p50':>13} {'doc TTFT max':>13} {'failed':>7}"
    )
    for mode, itls, ttfts, failures in rows:
        print(
            f"{mode:<18} {pct(itls, 50) * 1e3:>7.0f}ms {pct(itls, 99) * 1e3:>7.0f}ms "
            f"{max(itls, default=0) * 1e3:>7.0f}ms "
            f"{median(ttfts):>12.2f}s {max(ttfts, default=0):>12.2f}s {failures:>7}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
