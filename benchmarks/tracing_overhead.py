"""The cost of OpenTelemetry tracing (docs/observability.md): ITL p50 and TTFT p50 at
concurrency 8 on two disaggregated servers side by side, one without tracing, one exporting
every request's spans (100 % sampled) over OTLP/HTTP to a receiver in this script; the runs
interleave (off, on, on, off, off, on, ...) so that the machine's drift hits both alike.
Target: on at most 3 % worse than off. Prints a table of medians over the rounds and the ratio.

    .venv/bin/python benchmarks/tracing_overhead.py [--rounds 3] [--requests 32]
        [--prompt 256] [--output 64] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _otlp import Receiver  # noqa: E402
from _servers import closed_loop, server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    sink = Receiver()
    common = ("--local-prefill-threshold", "0")
    results: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp, server("disagg", *common) as off_url, server(
        "disagg", *common, "--otlp-traces-endpoint", sink.url
    ) as on_url:  # fmt: skip
        urls = {"off": off_url, "on": on_url}
        for name, url in urls.items():  # warm-up, not counted
            closed_loop(url, args.concurrency, args.concurrency, args.prompt, 8,
                        Path(tmp) / f"warm-{name}")  # fmt: skip
        for i in range(args.rounds):  # off first in even rounds, on first in odd ones
            for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
                url = urls[name]
                agg = closed_loop(url, args.concurrency, args.requests, args.prompt,
                                  args.output, Path(tmp) / f"{name}-{i}")  # fmt: skip
                results[name].append(agg)
                print(f"round {i + 1} {name}: TTFT p50 {agg['ttft_s']['p50'] * 1000:.1f} ms, "
                      f"ITL p50 {agg['itl_s']['p50'] * 1000:.2f} ms", flush=True)  # fmt: skip
    med = {
        name: {k: statistics.median(a[k]["p50"] for a in runs) for k in ("ttft_s", "itl_s")}
        for name, runs in results.items()
    }
    print(f"\nconcurrency {args.concurrency}, {args.requests} requests x {args.rounds} rounds, "
          f"prompt {args.prompt}, output {args.output}; {len(sink.spans)} spans "
          "received\n")  # fmt: skip
    print("| tracing | TTFT p50 ms | ITL p50 ms |\n|---|---|---|")
    for name in ("off", "on"):
        print(f"| {name} | {med[name]['ttft_s'] * 1000:.1f} | {med[name]['itl_s'] * 1000:.2f} |")
    ratio = {k: med["on"][k] / med["off"][k] for k in ("ttft_s", "itl_s")}
    print(f"| on / off | {ratio['ttft_s']:.3f} | {ratio['itl_s']:.3f} |")


if __name__ == "__main__":
    main()
