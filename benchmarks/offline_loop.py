"""The served closed loop without a server: one `LLMEngine` in this process keeps C requests in
flight (N-token prompts of random ids, M tokens out, ignore_eos, greedy; a finished request is
replaced at once) in chunks of the co-located worker's budget, and splits the time between the
steps that compute prompt tokens (with the decodes beside them) and the decode-only steps.

What `pdserve serve --mode colocated` + `pdserve bench --concurrency C` would give less the
router, the load generator and the sockets (~5 % at 16 on 2 cores): the figure to compare two
builds of the engine with, alternating runs on a noisy machine.

    .venv/bin/python benchmarks/offline_loop.py --concurrency 16 [--rounds 3] [--chunk-size 1024]
"""

from __future__ import annotations

import argparse
import random
import time

from pdserve.config import KV_CACHE_DTYPES, WORKER_CHUNK_SIZE, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_perf import phase_counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (16)")
    ap.add_argument("--rounds", type=int, default=3, help="requests = rounds x concurrency (3)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--chunk-size", type=int, default=WORKER_CHUNK_SIZE["both"],
                    help="prompt tokens a step (default: the co-located worker's)")  # fmt: skip
    ap.add_argument("--weights", default="auto", help="auto | bf16 | int8 | int4")
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="auto (the model's dtype) | int8 (model/kv_int8.py)")  # fmt: skip
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens a KV block (default: a co-located engine's, 128)")  # fmt: skip
    args = ap.parse_args()
    c = args.concurrency
    config = EngineConfig(
        model=args.model, weights=args.weights, chunk_size=args.chunk_size,
        max_num_seqs=max(64, c), kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
    )  # fmt: skip
    engine = LLMEngine(config)
    engine.warm_up()
    rng, vocab = random.Random(0), engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True, temperature=0.0)
    total, sent, tokens = args.rounds * c, 0, 0

    def add() -> None:
        nonlocal sent
        ids = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
        engine.add_request(ids, params, request_id=f"r{sent}")
        sent += 1

    for _ in range(c):
        add()
    schedule, kinds = engine.scheduler.schedule, {"prompt": [0, 0.0], "decode": [0, 0.0]}
    last = []

    def counted():
        batch = schedule()
        last[:] = [phase_counts(batch)[0] if batch.seqs else 0]
        return batch

    engine.scheduler.schedule = counted
    start = time.perf_counter()
    while engine.has_work():
        t = time.perf_counter()
        outs = engine.step()
        kind = kinds["prompt" if last and last[0] else "decode"]
        kind[0], kind[1] = kind[0] + 1, kind[1] + time.perf_counter() - t
        for out in outs:
            tokens += 1
            if out.finished and sent < total:
                add()
    elapsed = time.perf_counter() - start
    print("| concurrency | requests | output tok/s | steps with prompt tokens | decode steps |")
    print("|---|---|---|---|---|")
    cells = [f"{n} x {1e3 * s / max(n, 1):.1f} ms ({100 * s / elapsed:.0f} %)" for n, s in
             kinds.values()]  # fmt: skip
    print(f"| {c} | {total} | {tokens / elapsed:.1f} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
