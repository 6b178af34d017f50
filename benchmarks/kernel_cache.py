"""Prefill speed with the CPU kernel caches bounded at different sizes (`envs.bound_kernel_caches`).

Each size runs in a process of its own (the variables must be set before torch starts), the
sizes in turn, for --rounds rounds, so that the machine's drift touches every size alike. Each
process prefills fresh random prompts of 512 and 2,048 tokens alternately, --repeats times
(the first of each left out), prefix caching off, 2 threads, and prints its medians.

    .venv/bin/python benchmarks/kernel_cache.py [--sizes 64,256,1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LENGTHS = (512, 2048)


def measure(seed: int, repeats: int) -> dict[int, float]:
    import numpy as np

    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    llm = LLM(enable_prefix_caching=False, num_threads=2)
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=1, temperature=0)
    speeds: dict[int, list[float]] = {n: [] for n in LENGTHS}
    for _ in range(repeats):
        for n in LENGTHS:
            llm.engine.add_request(rng.integers(100, 40000, n).tolist(), params)
            t = time.perf_counter()
            while llm.engine.has_work():
                llm.engine.step()
            speeds[n].append(n / (time.perf_counter() - t))
    return {n: statistics.median(v[1:]) for n, v in speeds.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64,256,1024", help="cache entries to compare")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=6, help="prompts of each length per process")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.repeats)))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    got: dict[int, list[dict]] = {s: [] for s in sizes}
    for r in range(args.rounds):
        for s in sizes:
            env = {**os.environ, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(s),
                   "LRU_CACHE_CAPACITY": str(s)}  # fmt: skip
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(r), "--repeats", str(args.repeats)],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            got[s].append(json.loads(out.stdout.strip().splitlines()[-1]))
            speeds = ", ".join(f"{n} tokens {v:,.0f} tok/s" for n, v in got[s][-1].items())
            print(f"round {r + 1}, {s} entries: {speeds}", flush=True)
    print("\nentries  " + "  ".join(f"prefill {n} (median tok/s)" for n in LENGTHS))
    for s in sizes:
        meds = [statistics.median(run[str(n)] for run in got[s]) for n in LENGTHS]
        print(f"{s:>7}  " + "  ".join(f"{m:>24,.0f}" for m in meds))


if __name__ == "__main__":
    main()
