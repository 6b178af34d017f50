"""Decode steps by KV block size: one `LLMEngine` a block size in this process, each holding the
same B sequences of CTX random prompt tokens on blocks taken in a shuffled order (as a server's
blocks lie once it has reused them), their decode steps timed in runs of 5, engine after engine,
the order reversed every round, so a drift of the machine's speed falls on all alike. Prints a
table of the median and minimum step per block size, against the first's.

    .venv/bin/python benchmarks/block_size.py [--sizes 16,128] [--batch 64] [--context 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import OrderedDict

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams


def filled_engine(block_size: int, batch: int, context: int, shuffle: bool) -> LLMEngine:
    """An engine whose `batch` sequences have their prompts computed and decode next."""
    engine = LLMEngine(EngineConfig(max_num_seqs=max(64, batch), block_size=block_size))
    engine.warm_up()
    blocks = engine.block_manager
    if shuffle:
        ids = list(blocks.free_queue)
        random.Random(1).shuffle(ids)
        blocks.free_queue = OrderedDict((i, None) for i in ids)
    rng, vocab = random.Random(0), engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(
            [rng.randrange(100, vocab) for _ in range(context)], params, request_id=f"r{i}"
        )
    while len(engine.step()) < batch:  # prompt steps until a step decodes every sequence
        pass
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16,128", help="block sizes, comma-separated (16,128)")
    ap.add_argument("--batch", type=int, default=64, help="sequences a step (64)")
    ap.add_argument("--context", type=int, default=300, help="prompt tokens each (300)")
    ap.add_argument("--rounds", type=int, default=12, help="runs of 5 steps per engine (12)")
    ap.add_argument("--in-order", action="store_true", help="blocks in order, not shuffled")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    engines = [filled_engine(s, args.batch, args.context, not args.in_order) for s in sizes]
    times: list[list[float]] = [[] for _ in sizes]
    for r in range(args.rounds):
        order = range(len(sizes)) if r % 2 == 0 else reversed(range(len(sizes)))
        for k in order:
            for _ in range(5):
                start = time.perf_counter()
                engines[k].step()
                times[k].append(time.perf_counter() - start)
    first = statistics.median(times[0])
    print(f"{args.batch} sequences from {args.context} tokens, "
          f"{'blocks in order' if args.in_order else 'shuffled blocks'}")  # fmt: skip
    print("| block size | decode step, median | min | x the first's median |")
    print("|---|---|---|---|")
    for size, ts in zip(sizes, times, strict=True):
        med = statistics.median(ts)
        print(f"| {size} | {1e3 * med:.1f} ms | {1e3 * min(ts):.1f} ms | {med / first:.3f} |")


if __name__ == "__main__":
    main()
