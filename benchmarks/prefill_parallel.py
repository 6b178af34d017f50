"""Prefill parallelism side by side: prefill pipeline-parallel 2 vs tensor-parallel 2 (the
smallest size that splits the model, when 2 does not: 3 for the bundled SmolLM2) vs one prefill
worker of 2 threads, each disaggregated to one decode worker (`pdserve serve`, the
bundled model unless --model), on the same machine in one run.

For each prompt length (2,048 and 8,192 tokens by default; a length past the model's context is
cut to fit, and the table says so): TTFT of one request at a time (median of --rounds, fresh
random prompts, so no prefix hits) and prefill throughput (--concurrent requests at once: their
prompt tokens over the time until the last first token). Then the KV bytes each pipeline stage
pushed for one prompt, measured in-process on the real connectors (a prefill engine of 2
stages, a decode engine, tcp) against each stage's share of the layers: they must be equal.

What to expect: the point of prefill PP is several hosts, each stage with its own cores and its
own link for its layers' KV; on one 2-core machine the 2 stages share the cores with the decode
worker and each step pays a hop, so PP 2 is expected to lose to TP 2 and to one worker of 2
threads there. Do not spend a shared machine on long runs of this.

    .venv/bin/python benchmarks/prefill_parallel.py [--tokens 2048,8192] [--rounds 3]
        [--concurrent 2] [--model PATH] [--only pp,tp,threads] [--no-kv-check]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _servers import server, stream_timings  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from factories import hand_off  # noqa: E402


def variants(model_config) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (what the table calls it, serve flags). TP 2 where the model's heads split by
    2, else the smallest size above 1 that splits them (the bundled SmolLM2, 9 query heads and
    3 KV heads: 3), said in its label."""
    from pdserve.engine.tp.shard import TPShard

    def splits(n: int) -> bool:
        try:
            TPShard(0, n).check(model_config)
        except ValueError:
            return False
        return True

    tp = next(n for n in range(2, model_config.num_heads + 1) if splits(n))
    why = "" if tp == 2 else f" (TP 2 does not split the model's {model_config.num_heads} heads)"
    return {
        "pp": ("prefill PP 2", ("--prefill-pp", "2")),
        "tp": (f"prefill TP {tp}{why}", ("--prefill-tp", str(tp))),
        "threads": ("1 prefill worker, 2 threads", ("--prefill-args", "--threads 2")),
    }


def prompt_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]  # random: no prefix-cache hits


def measure(url: str, lengths: list[int], rounds: int, concurrent: int, seed: int) -> dict:
    """{length: (median TTFT s, prefill tokens/s)} on the server at `url`."""
    rng, out = random.Random(seed), {}
    stream_timings(url, prompt_ids(rng, 64), 2)  # first request's one-off costs
    for n in lengths:
        ttft = statistics.median(
            stream_timings(url, prompt_ids(rng, n), 2)[0] for _ in range(rounds)
        )
        prompts = [prompt_ids(rng, n) for _ in range(concurrent)]
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrent) as pool:
            list(pool.map(lambda p: stream_timings(url, p, 1), prompts))
        out[n] = (ttft, concurrent * n / (time.perf_counter() - start))
    return out


def stage_bytes(model: str | None, tokens: int) -> tuple[list[int], list[int]]:
    """(bytes each stage of a 2-stage prefill engine pushed for one `tokens` prompt, each
    stage's share of the layers' bytes), on the real tcp connector, in this process."""
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kv_transfer import make_receiver
    from pdserve.protocol import messages as m
    from pdserve.serving.build import kv_layout, prefill_sender
    from pdserve.serving.worker_config import WorkerConfig

    d_engine = LLMEngine(EngineConfig(model=model, role="decode"))
    p_engine = LLMEngine(EngineConfig(model=model, role="prefill", pipeline_parallel_size=2))
    d_layout, p_layout = kv_layout(d_engine), kv_layout(p_engine)
    receiver = make_receiver("tcp", d_layout, d_engine.runner.k_caches, d_engine.runner.v_caches)
    receiver.start()
    config = WorkerConfig(p_engine.config, ("tcp://127.0.0.1:1",), "p0")
    sender = prefill_sender(config, p_engine, p_layout, p_engine.runner.rank_caches)
    try:
        ids = prompt_ids(random.Random(1), tokens)
        params = m.Params(max_tokens=1, ignore_eos=True)
        _, _, placement = hand_off(p_engine, d_engine, sender, receiver, ids, params, "kv")
        blocks = len(placement.block_ids) - placement.num_cached_tokens // p_layout.block_size
        share = [len(r) * p_layout.tensors * blocks * p_layout.block_bytes
                 for r in p_engine.runner.pp.layers]  # fmt: skip
        return [s.bytes for s in sender.stage_stats()], share
    finally:
        receiver.close()
        sender.close()
        d_engine.close()
        p_engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="2048,8192", help="prompt lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="sequential requests per length")
    ap.add_argument("--concurrent", type=int, default=2, help="requests at once (throughput)")
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--only", default="pp,tp,threads", help="variants: pp,tp,threads")
    ap.add_argument("--no-kv-check", action="store_true", help="skip the bytes per stage")
    args = ap.parse_args()
    from pdserve.model.loader import load_model_config

    model_config = load_model_config(args.model)[1]
    limit = model_config.max_position_embeddings - 2  # + the output
    table = variants(model_config)
    asked = [int(t) for t in args.tokens.split(",")]
    lengths = [min(t, limit) for t in asked]
    common = ["--decode", "1", "--prefill", "1", "--local-prefill-threshold", "0"]
    if args.model:
        common += ["--model", args.model]
    results = {}
    for name in args.only.split(","):
        label, flags = table[name]
        with server("disagg", *common, *flags) as url:
            results[label] = measure(url, lengths, args.rounds, args.concurrent, seed=0)
    print(f"\nprefill, disaggregated to 1 decode worker; TTFT median of {args.rounds}, "
          f"throughput at {args.concurrent} at once")  # fmt: skip
    width = max(map(len, results)) + 2
    print(f"{'variant':<{width}}" + "".join(f"{f'{n} tok TTFT':>16}{'tok/s':>10}" for n in lengths))
    for label, per in results.items():
        cells = "".join(f"{per[n][0]:>15.2f}s{per[n][1]:>10.0f}" for n in lengths)
        print(f"{label:<{width}}{cells}")
    cut = [f"{a} -> {n}" for a, n in zip(asked, lengths, strict=True) if a != n]
    if cut:
        print(f"(prompt lengths cut to the model's context: {', '.join(cut)})")
    if not args.no_kv_check:
        sent, share = stage_bytes(args.model, lengths[0])
        print(f"\nKV bytes per stage for one {lengths[0]}-token prompt (PP 2, tcp):")
        for s, (b, want) in enumerate(zip(sent, share, strict=True)):
            print(f"  stage {s}: {b:,} bytes (its layers' share: {want:,}"
                  f"{', equal' if b == want else ', DIFFERENT'})")  # fmt: skip


if __name__ == "__main__":
    main()
