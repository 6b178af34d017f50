"""A served worker's cost outside the model: CPU an idle worker burns, and one stream's ITL.

Starts `pdserve serve` (disaggregated, the bundled model), reads each worker's CPU time from
/proc over an idle window, then streams requests one at a time (256-token prompts, 128 out)
and reports the ITL p50/p90 at the client. Run it from two checkouts side by side to compare
(e.g. before and after a change to the worker loop); each run prints one table row.

    .venv/bin/python benchmarks/worker_overhead.py [--idle-s 10] [--requests 8] [--label NAME]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _servers import median, pct, server, stream_timings  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def idle_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Each process's CPU use over an idle window, in % of one core."""
    start = {name: cpu_s(pid) for name, pid in pids.items()}
    time.sleep(seconds)  # the measured window itself: nothing is waited for
    return {name: 100 * (cpu_s(pid) - start[name]) / seconds for name, pid in pids.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--idle-s", type=float, default=10.0, help="idle window (default 10 s)")
    ap.add_argument("--requests", type=int, default=8, help="streams at concurrency 1")
    ap.add_argument("--label", default=str(Path.cwd().name), help="the row's name")
    args = ap.parse_args()
    with server("disagg") as url:
        health = httpx.get(url.removesuffix("/v1") + "/health", timeout=10).json()
        pids = {wid: w["pid"] for wid, w in health["workers"].items()}
        time.sleep(2.0)  # let start-up work (warm-up, registration) finish before the window
        idle = idle_cpu(pids, args.idle_s)
        prompt = list(range(1000, 1256))
        itls = []
        for _ in range(args.requests):
            _, gaps = stream_timings(url, prompt, 128)
            itls += gaps
    cells = "  ".join(f"{wid} idle {idle[wid]:5.2f} %" for wid in sorted(idle))
    print(
        f"{args.label:<12} {cells}  ITL p50 {1000 * median(itls):5.2f} ms  "
        f"p90 {1000 * pct(itls, 90):5.2f} ms"
    )


if __name__ == "__main__":
    main()
