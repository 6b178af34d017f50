"""How steady is this machine? The same decode, timed over and over, on each core at once.

The simulator is calibrated on one stretch of time and compared with the real server on
another (`benchmarks/sim_vs_real.py`), so its accuracy can be no better than the machine holds
its speed between them. This runs one engine per core (one thread each, pinned), each
generating the same 100-token greedy completion again and again for `--seconds`, and prints
the median time per output token in every `--window`-second window, relative to the whole
run's median, side by side. The engine does the same work every time, so what moves is the
machine (here: a VM whose cores and memory bandwidth are shared with other tenants).

    .venv/bin/python benchmarks/machine_drift.py [--seconds 120] [--window 10] [--cores 0,1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = list(range(100, 200))
TOKENS = 100


def worker(seconds: float) -> None:
    """Child process: decode until `seconds` have passed; print (t, seconds/token) as JSON."""
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = LLM(num_threads=1)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    llm.generate([PROMPT], params)  # warm-up
    out, start = [], time.time()
    while time.time() < start + seconds:
        t0 = time.perf_counter()
        (r,) = llm.generate([PROMPT], params)
        out.append((time.time(), (time.perf_counter() - t0) / max(len(r.token_ids), 1)))
    print(json.dumps(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="how long to decode (s)")
    ap.add_argument("--window", type=float, default=10.0, help="window for each median (s)")
    ap.add_argument("--cores", default="0,1", help="cores to run one engine on each")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.seconds)
        return 0
    if args.seconds < 2 * args.window or args.window <= 0:
        ap.error("--seconds must cover at least two --window s")
    cores = [c for c in args.cores.split(",") if c]
    print(f"decoding for {args.seconds:g} s on cores {', '.join(cores)} ...", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", "--seconds", str(args.seconds)]
    procs = [
        subprocess.Popen(["taskset", "-c", c, *cmd], stdout=subprocess.PIPE, text=True, env=env)
        for c in cores
    ]
    runs = []
    for c, p in zip(cores, procs, strict=True):
        stdout, _ = p.communicate()
        if p.returncode != 0:
            print(f"the engine on core {c} failed (exit {p.returncode})", file=sys.stderr)
            return 1
        runs.append(json.loads(stdout.strip().splitlines()[-1]))
    start = min(r[0][0] for r in runs)
    windows = int(args.seconds // args.window)
    per_core = []  # per core: (whole-run median, median of each window or None)
    for r in runs:
        by_window = [[] for _ in range(windows)]
        for t, s in r:
            if (w := int((t - start) // args.window)) < windows:
                by_window[w].append(s)
        per_core.append((statistics.median(s for _, s in r),
                         [statistics.median(xs) if xs else None for xs in by_window]))  # fmt: skip
    print("| window (s) | " + " | ".join(f"core {c}: ms/token (x median)" for c in cores) + " |")
    print("|---|" + "---|" * len(cores))
    for w in range(windows):
        cells = [f"{m[w] * 1e3:.1f} ({m[w] / med:.2f})" if m[w] else "-" for med, m in per_core]
        print(f"| {w * args.window:g}-{(w + 1) * args.window:g} | " + " | ".join(cells) + " |")
    for c, (med, m) in zip(cores, per_core, strict=True):
        seen = [x for x in m if x]
        print(f"core {c}: median {med * 1e3:.1f} ms/token; windows span "
              f"{min(seen) / med:.2f}-{max(seen) / med:.2f} x median")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
