"""What structured outputs and logprobs cost while serving: inter-token latency at a fixed
concurrency with each feature on and off, on one `pdserve serve` (default: disaggregated).

Closed loop, `--concurrency` chat streams; the variants take turns in `--rounds` rounds of
`--duration` seconds each so that the machine's drift falls on all of them alike. Prints ITL
p50/p90 per variant (pooled over rounds), the median of the per-round p50s, and the ratio of
that median to the feature-off one.

    .venv/bin/python benchmarks/api_cost.py [--concurrency 8] [--rounds 3] [--duration 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _servers import median, pct, server  # noqa: E402

from pdserve.bench.client import Endpoint, make_client, send_request  # noqa: E402
from pdserve.bench.prompts import load_prompt_builder  # noqa: E402
from pdserve.bench.workload import RequestSpec  # noqa: E402

SCHEMA = {  # long enough to keep a stream going: a list of short records
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 30,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"enum": [1, 2]}},
                "required": ["name", "n"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
VARIANTS = {
    "off": None,
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    },
    "json_object": {"response_format": {"type": "json_object"}},
    "logprobs top 5": {"logprobs": True, "top_logprobs": 5},
}


async def run(url: str, extra: dict | None, args, builder) -> tuple[list[float], int, int]:
    """Every inter-token interval of the streams, requests completed, requests failed."""
    ep = Endpoint(url, api="chat", timeout_s=600, extra_body=json.dumps(extra) if extra else None)
    itls, done, failed = [], 0, 0
    t0 = time.perf_counter()
    stop_at = t0 + args.duration
    counter = iter(range(1_000_000))

    async def stream(client):
        nonlocal done, failed
        while time.perf_counter() < stop_at:
            spec = RequestSpec(next(counter), 0.0, "chat", args.prompt_tokens, args.output)
            rec = await send_request(client, ep, spec, builder.build(spec), t0)
            if rec.status == "ok":
                itls.extend(rec.itl_s)
                done += 1
            else:
                failed += 1

    async with make_client() as client:
        await asyncio.gather(*(stream(client) for _ in range(args.concurrency)))
    return itls, done, failed


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mode", choices=("disagg", "colocated"), default="disagg")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per variant per round")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output", type=int, default=64, help="max tokens per request")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    names = args.variants.split(",")
    builder = load_prompt_builder("bundled", seed=0)
    pooled = {n: [] for n in names}
    p50s = {n: [] for n in names}
    counts = {n: [0, 0] for n in names}
    with server(args.mode) as url:
        asyncio.run(run(url, None, argparse.Namespace(**{**vars(args), "duration": 5}), builder))
        for r in range(args.rounds):
            for name in names:
                itls, done, failed = asyncio.run(run(url, VARIANTS[name], args, builder))
                pooled[name] += itls
                p50s[name].append(pct(itls, 50))
                counts[name][0] += done
                counts[name][1] += failed
                print(f"round {r + 1} {name}: ITL p50 {pct(itls, 50) * 1e3:.1f} ms, "
                      f"{done} requests, {failed} failed", flush=True)  # fmt: skip
    base = median(p50s[names[0]])
    print(
        f"\n{args.mode}, concurrency {args.concurrency}, {args.rounds} rounds x {args.duration:g} s"
    )
    print(f"{'variant':<16} {'ITL p50':>9} {'ITL p90':>9} {'median p50':>11} {'vs off':>7} "
          f"{'requests':>9} {'failed':>7}")  # fmt: skip
    for name in names:
        m, itls = median(p50s[name]), pooled[name]
        print(
            f"{name:<16} {pct(itls, 50) * 1e3:>7.1f}ms {pct(itls, 90) * 1e3:>7.1f}ms"
            f" {m * 1e3:>9.1f}ms {m / base:>6.2f}x {counts[name][0]:>9} {counts[name][1]:>7}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
