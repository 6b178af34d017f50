"""How much does a busy neighbouring core slow a one-core decode on this machine?

`pdserve serve` gives each worker a core of its own, and the simulator treats the instances as
independent. They still share the memory system. This times the same one-thread greedy decode
of the bundled model on core 0 (median ms per output token over `--seconds`) while core 1 is
idle, runs a matmul loop (compute-bound, like a prefill) or streams through 512 MB (memory
bound, like a decode), in turn, `--rounds` times.

    .venv/bin/python benchmarks/neighbour.py [--seconds 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

NEIGHBOURS = {
    "idle": None,
    "matmul": "import torch; torch.set_num_threads(1); a = torch.randn(1024, 1024)\n"
    "while True: a @ a",
    "memory": "import numpy as np; a = np.ones(64 << 20)\nwhile True: a.sum()",
}


def decode_ms(engine, seconds: float) -> float:
    """Median ms per output token of 40-token greedy decodes of a 128-token prompt."""
    from pdserve import SamplingParams

    per_token, end = [], time.time() + seconds
    while time.time() < end:
        seq = engine.add_request(list(range(100, 228)), SamplingParams(max_tokens=40,
                                                                      ignore_eos=True))  # fmt: skip
        while seq.num_output_tokens < 2:  # the prefill and first decode: not timed
            engine.step()
        start, steps = time.perf_counter(), 0
        while engine.has_work():
            engine.step()
            steps += 1
        per_token.append((time.perf_counter() - start) / steps)
    return statistics.median(per_token) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="per measurement")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cores", default="0,1", help="the decode's core and the neighbour's")
    args = ap.parse_args()
    mine, theirs = (int(c) for c in args.cores.split(","))
    os.sched_setaffinity(0, {mine})
    from pdserve import LLM

    engine = LLM(device="cpu", num_threads=1).engine
    decode_ms(engine, 2.0)  # warm-up
    results: dict[str, list[float]] = {name: [] for name in NEIGHBOURS}
    for _ in range(args.rounds):
        for name, code in NEIGHBOURS.items():
            proc = None
            if code is not None:
                pin = f"import os; os.sched_setaffinity(0, {{{theirs}}})\n"
                proc = subprocess.Popen([sys.executable, "-c", pin + code])
                time.sleep(1.0)
            results[name].append(decode_ms(engine, args.seconds))
            if proc is not None:
                proc.kill()
                proc.wait()
            print(f"core {theirs} {name:<7} core {mine} decode {results[name][-1]:6.1f} ms/token",
                  flush=True)  # fmt: skip
    idle = statistics.median(results["idle"])
    print(f"\n| core {theirs} | core {mine} decode ms/token (median of rounds) | vs idle |")
    print("|---|---|---|")
    for name, ms in results.items():
        med = statistics.median(ms)
        print(f"| {name} | {med:.1f} ({', '.join(f'{x:.1f}' for x in ms)}) | {med / idle:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
