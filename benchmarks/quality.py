"""Quality of the weight formats: perplexity on a fixed held text and greedy tokens against
bf16, with llama.cpp's own perplexity of the same GGUF as the reference to beat.

Perplexity as llama-perplexity computes it: the text's tokens cut into chunks of --ctx (512),
each scored on its second half. The text is fed 8 tokens a step, so every linear and the
lm_head run their decode-size (quantized) kernels; the "prefill steps" rows feed each chunk
whole, as a prefill, through the dense copies or int8 activations (model/act_quant.py). Greedy:
--max-tokens tokens from each of a fixed prompt set through the engine (the fused decode step),
compared token by token with bf16's.

    .venv/bin/python benchmarks/quality.py [--chunks 16] [--no-llama-cpp] [--only LABELS] [--out F]

Held text: benchmarks/data/held_text.txt, the docstrings of 38 CPython 3.11 standard library
modules (PSF license), 60,000 characters.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from pdserve.envs import INT8_ACT_ROWS

HERE = Path(__file__).resolve().parent
TEXT = HERE / "data" / "held_text.txt"
STEP = 8  # tokens per step, at most: fewer where a quantized kernel runs only to fewer rows
# (label, --weights, --int8-activations, tokens per step: STEP, or None for whole chunks as a
# prefill computes them: above the quantized kernels' rows, int8 activations or the dense copy;
# --kv-cache-dtype: with int8, each step's attention reads the earlier tokens' 8-bit rows)
VARIANTS = (
    ("bf16", "bf16", "off", STEP, "auto"),
    ("int8", "int8", "off", STEP, "auto"),
    ("int4", "int4", "off", STEP, "auto"),
    ("int4, prefill steps, dense copy", "int4", "off", None, "auto"),
    ("int4, prefill steps, int8 activations", "int4", "on", None, "auto"),
    ("bf16, int8 KV cache", "bf16", "off", STEP, "int8"),
    ("int4, int8 KV cache", "int4", "off", STEP, "int8"),
)
BARS = {"bf16": "-", "int8": "<= +1 %", "int4": "<= +3 %"}
KV_BAR = "<= +1 % over its weights' row"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "The three laws of thermodynamics state that",
    "import numpy as np\n\ndef softmax(x):",
    "Q: What is 17 times 3?\nA:",
    "Water boils at",
]


def quantized_linears(model) -> list:
    """Every linear that runs a quantized kernel for small steps (none in bf16)."""
    return [x for x in [*model.linears(), model.lm_head] if x.max_rows > 0]


def chunk_nll(llm, ids: list[int], step: int | None = STEP) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[n/2 + 1:] given what precedes, and its count."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.scheduler import ScheduledBatch
    from pdserve.engine.sequence import Sequence
    from pdserve.model import quant

    runner, bm = llm.engine.runner, llm.engine.block_manager
    seq = Sequence("ppl", ids, SamplingParams(max_tokens=1))
    assert bm.allocate(seq)
    logits = []
    if step is None:
        step = len(ids)
    else:
        step = min([step] + [x.max_rows for x in quantized_linears(runner.model)])
        # the text is a prompt, whose rows the engine keeps off the few-row kernels: score
        # those kernels (a decode step's) all the same
        quant.FEW_ROWS_FOR_PROMPTS = True
    try:
        with torch.inference_mode():
            for start in range(0, len(ids), step):
                n = min(step, len(ids) - start)
                seq.num_computed_tokens = start
                inp, pos, meta, *_ = runner._prepare(ScheduledBatch([seq], [n]))
                logits.append(runner.model.logits(runner.model(inp, pos, runner.kv_caches, meta)))
    finally:
        quant.FEW_ROWS_FOR_PROMPTS = False
        bm.free(seq)
    first = len(ids) // 2
    logp = torch.cat(logits)[first:-1].log_softmax(-1)
    target = torch.tensor(ids[first + 1 :])
    return -logp.gather(1, target[:, None]).sum().item(), len(target)


def perplexity(llm, tokens: list[int], ctx: int, chunks: int, step: int | None = STEP) -> float:
    nll, count = 0.0, 0
    for c in range(min(chunks, len(tokens) // ctx)):
        s, n = chunk_nll(llm, tokens[c * ctx : (c + 1) * ctx], step)
        nll, count = nll + s, count + n
    return math.exp(nll / count)


def greedy(llm, max_tokens: int) -> list[list[int]]:
    from pdserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[int, float]:
    """(prompts whose tokens all match, mean length of the matching prefix)."""
    prefix = [
        next((i for i, (a, b) in enumerate(zip(o, r, strict=False)) if a != b), len(r))
        for o, r in zip(ours, ref, strict=True)
    ]
    return sum(p == len(r) for p, r in zip(prefix, ref, strict=True)), sum(prefix) / len(prefix)


def llama_cpp_ppl(model: Path, threads: int, ctx: int, chunks: int) -> float | None:
    from _llamacpp import find_bin, no_repack

    binary = find_bin() / "llama-perplexity"
    cmd = [
        str(binary),
        *no_repack("llama-perplexity"),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-f",
        str(TEXT),
        "-c",
        str(ctx),
        "--chunks",
        str(chunks),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    return float(found.group(1)) if found else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=16, help="chunks of --ctx tokens scored")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp reference")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    ap.add_argument(
        "--only", default=None, help="rows whose label contains one of these (comma-separated), "
        "beside bf16, e.g. 'KV cache,int4'",
    )  # fmt: skip
    args = ap.parse_args()

    from pdserve import LLM

    rows, ref_tokens = {}, None
    for label, fmt, act, step, kv in VARIANTS:
        if args.only and not any(o in label for o in args.only.split(",")) and label != "bf16":
            continue  # bf16: the reference every row is compared with
        if act == "on":  # every step above the quantized kernels' rows, whatever is faster
            os.environ[INT8_ACT_ROWS] = str(1 << 30)
        llm = LLM(weights=fmt, dtype=args.dtype, num_threads=args.threads, int8_activations=act,
                  kv_cache_dtype=kv)  # fmt: skip
        os.environ.pop(INT8_ACT_ROWS, None)
        tokens = llm.tokenizer.encode(TEXT.read_text())
        ppl = perplexity(llm, tokens, args.ctx, args.chunks, step)
        toks = greedy(llm, args.max_tokens)
        ref_tokens = ref_tokens or toks
        same, prefix = agreement(toks, ref_tokens)
        rows[label] = {"ppl": ppl, "greedy_identical": same, "greedy_prefix": prefix}
        print(f"{label}: ppl {ppl:.4f}, greedy identical {same}/{len(PROMPTS)}", flush=True)
        path = llm.engine.files.path
        del llm
    ref = None if args.no_llama_cpp else llama_cpp_ppl(path, args.threads, args.ctx, args.chunks)
    base = rows["bf16"]["ppl"]
    print(
        f"\n{len(tokens)} tokens of held text, {min(args.chunks, len(tokens) // args.ctx)} "
        f"chunks of {args.ctx}; greedy: {len(PROMPTS)} prompts x {args.max_tokens} tokens\n"
    )
    print(
        "| weights | perplexity | vs bf16 | bar | greedy = bf16 (prompts) | mean agreeing prefix |"
    )
    print("|---|---|---|---|---|---|")
    for fmt, r in rows.items():
        bar = KV_BAR if "KV cache" in fmt else BARS[fmt.split(",")[0]]
        print(
            f"| {fmt} | {r['ppl']:.4f} | {100 * (r['ppl'] / base - 1):+.2f} % | {bar} | "
            f"{r['greedy_identical']}/{len(PROMPTS)} | {r['greedy_prefix']:.1f} tokens |"
        )
    if ref is not None:
        print(
            f"| llama.cpp (the GGUF's Q4_1, its own kernels) | {ref:.4f} | "
            f"{100 * (ref / base - 1):+.2f} % | reference | - | - |"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {"formats": rows, "llama_cpp_ppl": ref, "args": vars(args)}, default=str, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
