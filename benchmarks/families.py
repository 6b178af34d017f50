"""Decode speed per model family on tiny random-weight models (tests/family_models.py: 2 layers,
hidden 64, vocab 256; Llama added at the same shape): steady-state decode tok/s at batch 1 and
16, with the decode step each family gets (the fused C++ step for the dense ones, eager for
MoE: the worker's ready line says which), and Llama eager too, for the fused step's share. At
this size a step is almost all per-layer overhead, so the figures compare the families' Python
and kernel-call cost, not their FLOPs.

Every family's engine is built first, then the repeats run interleaved (family after family,
`--repeats` rounds) so a change in the machine's load hits all alike; figures are medians.

    .venv/bin/python benchmarks/families.py [--threads 1] [--steps 64] [--repeats 3]
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

BATCHES = (1, 16)


def build_all(folder: Path) -> dict[str, Path]:
    import transformers
    from family_models import BASE, FAMILIES, build

    out = {}
    for family in FAMILIES:
        out[family] = folder / family
        build(family, out[family])
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE))
    llama.save_pretrained(str(folder / "llama"))
    out["llama"] = folder / "llama"
    return out


def decode_tok_s(engine, batch: int, steps: int) -> float:
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    seqs = [engine.add_request([3 + (i * 7 + j) % 200 for j in range(16)], params)
            for i in range(batch)]  # fmt: skip
    engine.step()  # the prefills
    engine.step()  # one untimed decode step
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_work():
        engine.step()
    assert all(s.is_finished for s in seqs)
    return batch * steps / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.model.loader import load_model_files

    with tempfile.TemporaryDirectory() as tmp:
        folders = build_all(Path(tmp))

        def engine(folder: Path, **over) -> LLMEngine:
            config = EngineConfig(dtype="float32", device="cpu", weights="bf16", kv_cache_gb=0.05,
                                  max_num_seqs=16, **over)  # fmt: skip
            return LLMEngine(config, load_model_files(str(folder)))

        engines = {f: engine(d) for f, d in folders.items()}
        engines["llama eager"] = engine(folders["llama"], enforce_eager=True)  # the eager cost
        figures = {(f, b): [] for f in engines for b in BATCHES}
        for _ in range(args.repeats):
            for f, engine in engines.items():
                for b in BATCHES:
                    figures[f, b].append(decode_tok_s(engine, b, args.steps))
    print(f"decode tok/s, tiny models, float32, {args.threads} thread(s), medians of "
          f"{args.repeats}")  # fmt: skip
    print(f"{'family':<12} " + " ".join(f"{'B=' + str(b):>7}" for b in BATCHES) + "  decode step")
    for f, eng in engines.items():
        row = " ".join(f"{statistics.median(figures[f, b]):>7.0f}" for b in BATCHES)
        print(f"{f:<12} {row}  {eng.runner.decode_path}")


if __name__ == "__main__":
    main()
