"""One eager decode step of the tiny DeepSeek-V3 model (tests/family_models.py: 2 layers, hidden
64, 4 heads, latent 32 + 8, one MoE layer) with multi-head latent attention in the absorbed form
(what pdserve serves: W_UK folded into the query, W_UV into the output, only the latent read)
against the up-projected form (every cached latent expanded to per-head K and V each step).

The same decode batch (one token per sequence over the given contexts) runs `--steps` times per
engine; engines of the two forms alternate `--repeats` times, so a change in the machine's load
hits both alike; the figure is the median step time of each form over every step after the
first ten of each run.

Measured (2026-12-03, 2-core shared machine, 1 thread, float32), median step of this script
(3 x 90 steps per form): 8 sequences of 200 tokens: absorbed 1.67 ms, up-projected 3.01 ms
(1.8x); 3 sequences of 64, 128 and 200 tokens: absorbed 1.69 ms, up-projected 2.04 ms. At this
size a step is mostly per-layer overhead; the up-projection's cost grows with the context.

    .venv/bin/python benchmarks/mla_decode.py [--threads 1] [--contexts 199,199,...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny builders


def step_times(files, contexts: list[list[int]], absorbed: bool, steps: int) -> list[float]:
    from factories import make_engine
    from model.test_fused_decode import decode_batch

    engine = make_engine(files, enable_prefix_caching=False, kv_cache_gb=0.01)
    for layer in engine.runner.model.layers:
        layer.attn.absorbed = absorbed
    batch = decode_batch(engine, contexts)  # each context's length + 1 must not open a block
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.runner.run(batch)
        times.append(time.perf_counter() - start)
    return times[10:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    lengths = "prompt lengths, each 3 mod 4 (the tests' blocks hold 4 tokens)"
    parser.add_argument("--contexts", default=",".join(["199"] * 8), help=lengths)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from family_models import build

    from pdserve.model.loader import load_model_files

    folder = Path(tempfile.mkdtemp())
    build("deepseek_v3", folder)
    files = load_model_files(str(folder))
    contexts = [list(range(1, int(n) + 1)) for n in args.contexts.split(",")]
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for absorbed in (True, False):
            times[absorbed] += step_times(files, contexts, absorbed, args.steps)
    lengths = [len(c) + 1 for c in contexts]
    for absorbed, name in ((True, "absorbed"), (False, "up-projected")):
        ms = statistics.median(times[absorbed]) * 1e3
        print(f"{name:<13} median decode step {ms:.3f} ms  (contexts {lengths})")


if __name__ == "__main__":
    main()
