"""Decode through a pipeline, measured: why decode workers refuse `--decode-pp`.

Every decode step of a pipeline-parallel engine crosses every stage: stage 0 embeds and runs its
layers, sends the hidden states on (gloo), each stage runs its layers, and the last sends them
back for sampling, so a token pays one hop per stage, and the stages take turns (one step has
nothing to overlap with). This prints decode tokens/s and the step time (median over the timed
steps) of one co-located engine of the bundled model at batch 1 and 16, one process (the fused
step, and eager as the pipeline runs) against a pipeline of 2 stages, side by side:

    python benchmarks/decode_pipeline.py [--batches 1 16] [--steps 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

VARIANTS = {  # name -> engine settings (bf16 weights: a pipeline runs no int4 kernel)
    "1 process, fused step": dict(weights="bf16"),
    "1 process, eager": dict(weights="bf16", enforce_eager=True),
    "pipeline of 2 stages": dict(weights="bf16", pipeline_parallel_size=2),
}


def decode_steps(engine: LLMEngine, batch: int, context: int, steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps of `batch` sequences after `context` tokens."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for b in range(batch):
        engine.add_request([(b * 131 + i * 7) % vocab for i in range(context)], params)
    while any(s.num_output_tokens == 0 for s in engine.requests.values()):
        engine.step()  # the prompts, up to each sequence's first token
    times = []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times[:steps]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    p.add_argument("--rounds", type=int, default=2, help="runs per figure (variants interleaved)")
    args = p.parse_args()
    step_s: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):  # one engine at a time: a pipeline pins this process's cores
        for name, cfg in VARIANTS.items():
            engine = LLMEngine(EngineConfig(**cfg))
            try:
                engine.warm_up()
                for batch in args.batches:
                    times = decode_steps(engine, batch, args.context, args.steps)
                    step_s.setdefault((name, batch), []).extend(times)
            finally:
                engine.close()
    print(f"decode after {args.context} tokens, median step of {args.rounds} x {args.steps} "
          "steps (bundled SmolLM2, bf16 weights; x: against one process, eager)")  # fmt: skip
    print(f"{'variant':<24}" + "".join(f"{f'batch {b}':>30}" for b in args.batches))
    base = {b: statistics.median(step_s[("1 process, eager", b)]) for b in args.batches}
    for name in VARIANTS:
        row = f"{name:<24}"
        for b in args.batches:
            med = statistics.median(step_s[(name, b)])
            row += f"{med * 1e3:>9.1f} ms {b / med:>7.0f} tok/s {med / base[b]:>5.2f}x"
        print(row)


if __name__ == "__main__":
    main()
