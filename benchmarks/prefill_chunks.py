"""A prefill worker's prompt in one step against in chunks: time to compute a long prompt.

A prefill worker computes prompts in chunks (`config.WORKER_CHUNK_SIZE`) so that an Abort read
between two chunks stops a prompt whose client left; this measures what the chunks cost. One
engine per chunk size (role prefill, the bundled model, one thread as `serve` gives a prefill
worker), fresh prompts, rounds interleaved, medians.

    .venv/bin/python benchmarks/prefill_chunks.py [--tokens 4311] [--chunks 0,2048,1024,512]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import replace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4311)
    ap.add_argument("--chunks", default="0,2048,1024,512", help="0: the whole prompt at once")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    base = EngineConfig(role="prefill", num_threads=args.threads)
    sizes = [int(c) for c in args.chunks.split(",")]
    engines = {c: LLMEngine(replace(base, chunk_size=c or None)) for c in sizes}
    for engine in engines.values():
        engine.warm_up()
    rng, times = random.Random(0), {c: [] for c in sizes}
    for r in range(args.rounds):
        for c, engine in engines.items():
            ids = [rng.randrange(100, 40000) for _ in range(args.tokens)]  # no prefix hits
            start = time.perf_counter()
            seq = engine.add_request(ids, SamplingParams(max_tokens=1), request_id=f"r{r}")
            while engine.has_work():
                engine.step()
            times[c].append(time.perf_counter() - start)
            engine.release(seq.request_id)
    whole = statistics.median(times[sizes[0]])
    print(f"{args.tokens}-token prompt, {args.threads} thread(s), median of {args.rounds}:")
    for c, ts in times.items():
        med = statistics.median(ts)
        print(f"  {'whole' if not c else f'chunks of {c}':>16}: {med:6.2f} s "
              f"({med / whole:.2f}x of {'whole' if sizes[0] == 0 else sizes[0]})")  # fmt: skip


if __name__ == "__main__":
    main()
