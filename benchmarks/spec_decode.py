"""Speculative decoding (prompt lookup) vs plain decoding on the bundled model, in one process,
interleaved: three workloads (a) rewrite a code file with one change, (b) quote a passage of a
long prompt, (c) free chat; single stream and concurrency 8; greedy. Prints tok/s, ITL p50
(between a stream's chunks: a verify step may emit several tokens at once), the acceptance rate
and whether the outputs are identical.

    python benchmarks/spec_decode.py [--max-tokens 96] [--spec JSON] [--weights auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}  # fmt: skip
FILES = ["pdserve/engine/stops.py", "pdserve/engine/block.py", "pdserve/engine/prompt_check.py",
         "pdserve/engine/sampling_params.py", "pdserve/engine/block_hash.py",
         "pdserve/engine/kv_connector.py", "pdserve/engine/step_perf.py",
         "pdserve/engine/sequence.py"]  # fmt: skip
TOPICS = ["a dragon who learns to cook", "the history of bicycles", "why the sky is blue",
          "a trip to the mountains", "how bees make honey", "a robot that paints",
          "the life of a lighthouse keeper", "learning to play the violin"]  # fmt: skip


def workloads(engine: LLMEngine) -> dict[str, list[list[int]]]:
    tok = engine.tokenizer

    def chat(text: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": text}])

    code = [(ROOT / f).read_text()[:1800] for f in FILES]
    doc = (ROOT / "docs" / "architecture.md").read_text()
    paras = [p for p in doc.split("\n\n") if 300 < len(p) < 900][:8]
    return {
        "a) rewrite code": [
            chat(
                "Rewrite this file exactly, adding the comment `# reviewed` as its first "
                f"line; change nothing else.\n```python\n{c}\n```"
            )  # fmt: skip
            for c in code
        ],
        "b) quote passage": [
            chat(
                f"{doc[:5000]}\n\nQuote, word for word, the paragraph that begins with {p[:60]!r}."
            )  # fmt: skip
            for p in paras
        ],
        "c) free chat": [chat(f"Write a short story about {t}.") for t in TOPICS],
    }


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    last: dict[str, float] = {}
    gaps: list[float] = []
    first_done: float | None = None
    start = time.perf_counter()
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for rid in {o.seq.request_id for o in outs}:
            if rid in last:
                gaps.append(now - last[rid])
            last[rid] = now
        if first_done is None and any(len(s.output_token_ids) for s in seqs):
            first_done = now
    wall = time.perf_counter() - (first_done or start)  # decode time, after the prefills
    tokens = sum(len(s.output_token_ids) - 1 for s in seqs)
    return tokens / wall, statistics.median(gaps) * 1e3, [s.output_token_ids for s in seqs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--spec", default=json.dumps(SPEC))
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    base = LLMEngine(EngineConfig(weights=args.weights))
    spec = LLMEngine(EngineConfig(weights=args.weights, speculative_config=args.spec))
    for e in (base, spec):
        e.warm_up()
    loads = workloads(base)
    print(f"spec {args.spec}, weights {base.runner.weights}, {args.max_tokens} tokens, greedy")
    print(f"{'workload':18} {'c':>2} {'tok/s off':>9} {'tok/s on':>9} {'ratio':>6} "
          f"{'ITL p50 off':>11} {'ITL p50 on':>10} {'accept':>6} {'len':>5} identical")  # fmt: skip
    for name, prompts in loads.items():
        for c in args.concurrency:
            batch = prompts[:c]
            before = spec.stats()
            off = run(base, batch, args.max_tokens)
            on = run(spec, batch, args.max_tokens)
            after = spec.stats()
            prop = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
            acc = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            steps = after["spec_verify_steps"] - before["spec_verify_steps"]
            rate = acc / prop if prop else 0.0
            mean_len = (acc + steps) / steps if steps else 1.0
            print(f"{name:18} {c:>2} {off[0]:9.1f} {on[0]:9.1f} {on[0] / off[0]:5.2f}x "
                  f"{off[1]:9.1f}ms {on[1]:8.1f}ms {rate:6.2f} {mean_len:5.2f} "
                  f"{off[2] == on[2]}")  # fmt: skip
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
