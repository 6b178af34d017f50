"""What guided decoding costs per token, with the bundled model's tokenizer (vocab 49152).

For json_object, a small json_schema (a string, an integer, an enum and an array), and a
regex: random walks over the allowed tokens (seeded), `batch` sequences at a time, timing each
`GuideCompiler.fill_bitmask` call (the mask for the next token of every sequence of the batch,
computed by llguidance's thread pool) and each `apply_bitmask` on float32 (batch, 49152)
logits. A finished walk starts again with a fresh guide. Also prints one-off costs: building
the compiler (the llguidance tokenizer), a guide's first compile and a cached one, and whether
the fill runs beside Python code (it releases the GIL).

    .venv/bin/python benchmarks/guided_cost.py [--steps 300] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

import torch

from pdserve import envs
from pdserve.engine.guided import GuideCompiler, GuideSpec, apply_bitmask, unpack_bitmask
from pdserve.model.loader import fingerprint, load_model_config, load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "color", "tags"],
}
SPECS = {
    "json_object": GuideSpec("json_object"),
    "json_schema": GuideSpec("json_schema", json.dumps(SCHEMA)),
    "regex": GuideSpec("regex", r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){0,3}, [0-9]{1,5}"),
}


def us(seconds: list[float], q: float) -> float:
    """The q-quantile of `seconds`, in microseconds."""
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6


def measure(compiler: GuideCompiler, spec: GuideSpec, batch: int, steps: int, closers: set[int]):
    """Per-call seconds of fill_bitmask and apply_bitmask over `steps` steps of `batch` walks."""
    rng = random.Random(0)
    guides = [compiler.guide(spec) for _ in range(batch)]
    bitmask = compiler.allocate_bitmask(batch)
    fills, applies = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        compiler.fill_bitmask(guides, bitmask)
        fills.append(time.perf_counter() - t0)
        logits = torch.randn(batch, compiler.vocab_size)
        t0 = time.perf_counter()
        apply_bitmask(logits, bitmask)
        applies.append(time.perf_counter() - t0)
        rows = unpack_bitmask(bitmask, compiler.vocab_size)
        for i in range(batch):  # the walk: a random allowed token, closers preferred
            allowed = rows[i].nonzero().view(-1).tolist()
            closing = [t for t in allowed if t in closers]
            token = rng.choice(closing if closing and rng.random() < 0.3 else allowed)
            if token in compiler.eos_token_ids or guides[i].is_finished:
                guides[i] = compiler.guide(spec)
            else:
                guides[i].accept(token)
    return fills, applies


def gil_check(compiler: GuideCompiler, spec: GuideSpec, rows: int = 1024) -> str:
    """One long fill on a thread while this thread runs a Python loop: the loop's longest
    pause is about the fill's duration if the fill holds the GIL, far shorter if not."""
    guides = [compiler.guide(spec) for _ in range(rows)]
    bitmask = compiler.allocate_bitmask(rows)
    done, took = threading.Event(), []

    def fill() -> None:
        t0 = time.perf_counter()
        compiler.fill_bitmask(guides, bitmask)
        took.append(time.perf_counter() - t0)
        done.set()

    thread = threading.Thread(target=fill)
    pauses, last = [], time.perf_counter()
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        pauses.append(now - last)
        last = now
    thread.join()
    return (
        f"one fill of {rows} rows on a thread took {took[0] * 1e3:.1f} ms; a Python loop beside "
        f"it ran {len(pauses)} times, its longest pause {max(pauses) * 1e3:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None, help="llguidance's pool size")
    parser.add_argument("--torch-threads", type=int, default=1, help="for apply_bitmask")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    tokenizer = load_tokenizer(None)
    path, config = load_model_config(None)
    tokenizer_file = envs.cache_dir() / "tokenizers" / fingerprint(path, config) / "tokenizer.json"
    t0 = time.perf_counter()
    compiler = GuideCompiler(
        tokenizer_file, config.vocab_size, [tokenizer.eos_token_id], num_threads=args.threads
    )
    print(f"compiler (llguidance tokenizer from tokenizer.json): {time.perf_counter() - t0:.3f} s")
    for name, spec in SPECS.items():
        t0 = time.perf_counter()
        compiler.guide(spec).allowed()
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.guide(spec).allowed()
        print(
            f"{name}: first guide + mask {cold * 1e3:.2f} ms, "
            f"cached {(time.perf_counter() - t0) * 1e3:.2f} ms"
        )
    closers = {tokenizer.encode(c)[0] for c in ('"', "}", "]", ",")} | {tokenizer.eos_token_id}
    print(
        f"\nvocab {config.vocab_size}, {args.steps} steps, torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'spec':<12} {'batch':>5} {'fill p50 us':>12} {'fill p90 us':>12} {'us/seq p50':>11} "
        f"{'apply p50 us':>13} {'apply p90 us':>13}"
    )
    for name, spec in SPECS.items():
        for batch in (1, 8):
            fills, applies = measure(compiler, spec, batch, args.steps, closers)
            print(
                f"{name:<12} {batch:>5} {us(fills, 0.5):>12.0f} {us(fills, 0.9):>12.0f} "
                f"{us(fills, 0.5) / batch:>11.0f} {us(applies, 0.5):>13.0f} "
                f"{us(applies, 0.9):>13.0f}"
            )
    print("\n" + gil_check(compiler, SPECS["json_schema"]))


if __name__ == "__main__":
    main()
