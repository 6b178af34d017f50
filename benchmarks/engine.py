"""Engine speed: pdserve against Hugging Face transformers on the bundled GGUF, with rooflines.

Every system is loaded once into this process, then each workload runs its repeats interleaved
(ours, theirs, ours, ...) so a change in the machine's load hits all systems alike; figures are
medians. Workloads: prefill of one fresh prompt (tokens/s), and steady-state decode at a batch
size (every sequence already decoding; `--decode-steps` timed steps after one untimed one, greedy,
ignore_eos). transformers runs the same token ids through `model(...)` with its KV cache
(`logits_to_keep=1`); its decode batch is B prompts of equal length, so no padding.

    .venv/bin/python benchmarks/engine.py [--threads 1] [--quick] [--out engine.json]
    .venv/bin/python benchmarks/engine.py --profile    # where our time goes, no comparison
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import _roofline as rl  # sibling module: this script runs as a file, not a package
import torch

from pdserve.config import WEIGHT_FORMATS

PREFILL_TOKENS = (512, 2048)
DECODE_BATCHES = (1, 8, 16, 32)
HF_DECODE_BATCHES = (1, 16)


class Prompts:
    """Distinct token-id prompts, so the prefix cache never turns a prefill into a hit."""

    def __init__(self, vocab: int):
        self.vocab, self.count = vocab - 16, 0

    def make(self, n: int) -> list[int]:
        self.count += 1
        return [(self.count * 7919 + 31 * i * i + 17 * i) % self.vocab + 8 for i in range(n)]


def decode_weight_bytes(model) -> int:
    """Bytes of weights a small-batch decode step reads: each linear's quantized tensors (its
    dense weight when it has none), and the norms."""

    def size(lin) -> int:
        if lin.packed:
            return sum(t.numel() * t.element_size() for t in lin.packed)
        return math.prod(lin.shape) * model.norm.element_size()  # as held, packed or not

    linears = model.linears()
    norms = [model.norm] + [n for layer in model.layers for n in (layer.attn_norm, layer.mlp_norm)]
    return sum(map(size, [*linears, model.lm_head])) + sum(
        n.numel() * n.element_size() for n in norms
    )


class Ours:
    """pdserve's engine, driven step by step through `llm.engine`."""

    system = "pdserve"

    def __init__(
        self, dtype: str, threads: int | None, kv_cache_gb: float | None, device: str = "cpu",
        model: str | None = None, weights: str = "auto", enforce_eager: bool = False,
    ):  # fmt: skip
        from pdserve import LLM

        self.llm = LLM(model=model, dtype=dtype, device=device, num_threads=threads,
                       kv_cache_gb=kv_cache_gb, weights=weights,
                       enforce_eager=enforce_eager)  # fmt: skip
        runner = self.llm.engine.runner
        self.dtype = str(runner.dtype).removeprefix("torch.")
        label = f"{dtype}->{self.dtype}" if dtype == "auto" else dtype
        eager = "" if runner.fused else " eager"
        self.label = label if runner.weights == "bf16" else f"{label} {runner.weights}{eager}"
        # What a small step's weights take; above a linear's max_rows its dense copy runs.
        self.weight_bytes = decode_weight_bytes(runner.model)

    def prefill(self, ids: list[int]) -> float:
        from pdserve import SamplingParams

        start = time.perf_counter()
        self.llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
        return time.perf_counter() - start

    def start_decode(self, prompts: list[list[int]], steps: int) -> list:
        """Add the prompts and step until every sequence is decoding (one decode step done)."""
        from pdserve import SamplingParams

        eng = self.llm.engine
        # Headroom for the steps that admit the batch, in which the first admitted decode.
        params = SamplingParams(max_tokens=steps + 64, ignore_eos=True, temperature=0)
        seqs = [eng.add_request(p, params) for p in prompts]
        while any(s.num_output_tokens == 0 for s in seqs):
            eng.step()
        eng.step()  # untimed: the first step with every sequence decoding
        return seqs

    def decode(self, prompts: list[list[int]], steps: int) -> float:
        """Seconds per decode step once every sequence is decoding."""
        eng, seqs = self.llm.engine, self.start_decode(prompts, steps)
        # Long prompts take several steps to admit, and the first admitted decode meanwhile:
        # steady means every sequence gains one token per timed step, whatever it had before.
        before = [s.num_output_tokens for s in seqs]
        start = time.perf_counter()
        for _ in range(steps):
            eng.step()
        seconds = time.perf_counter() - start
        if any(s.num_output_tokens - n != steps for s, n in zip(seqs, before, strict=True)):
            raise RuntimeError("a sequence missed a decode step: the batch was not steady")
        for s in seqs:
            eng.abort(s.request_id)
        return seconds / steps


class Theirs:
    """transformers' AutoModelForCausalLM on the same GGUF file (or Hugging Face folder)."""

    system = "transformers"

    def __init__(self, dtype: str, device: str = "cpu", model: str | None = None):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from pdserve.model.loader import resolve_model_path

        hf_logging.set_verbosity_error()  # its advice to load GGUF in float32: we run both
        path, self.device = resolve_model_path(model), torch.device(device)
        where = {"gguf_file": path.name} if path.is_file() else {}
        with contextlib.redirect_stderr(io.StringIO()):  # its per-tensor progress bars
            self.model = (
                AutoModelForCausalLM.from_pretrained(
                    str(path.parent if path.is_file() else path),
                    dtype=getattr(torch, dtype),
                    **where,
                )
                .to(self.device)
                .eval()
            )
        weights = {str(p.dtype).removeprefix("torch.") for p in self.model.parameters()}
        self.dtype = dtype  # the roofline counts bytes in this dtype: say so if weights differ
        self.label = dtype if weights == {dtype} else f"{dtype} (weights {'/'.join(weights)})"

    def _sync(self) -> None:  # GPU work is queued: time it to its end, as ours (logits to CPU)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self.model(torch.tensor([ids], device=self.device), use_cache=True, logits_to_keep=1)
        self._sync()
        return time.perf_counter() - start

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], steps: int) -> float:
        out = self.model(torch.tensor(prompts, device=self.device), use_cache=True,
                         logits_to_keep=1)  # fmt: skip
        key = "cache" if hasattr(out, "cache") else "past_key_values"  # transformers < 5.2x
        cache, token = getattr(out, key), out.logits[:, -1].argmax(-1, keepdim=True)
        for timed in (False, True):  # one untimed step, as for ours
            self._sync()
            start = time.perf_counter()
            for _ in range(steps if timed else 1):
                out = self.model(token, **{key: cache}, use_cache=True, logits_to_keep=1)
                cache, token = getattr(out, key), out.logits[:, -1].argmax(-1, keepdim=True)
            self._sync()
        return (time.perf_counter() - start) / steps


class Bench:
    """Runs workloads over systems, interleaving repeats, and tracks each system's memory."""

    def __init__(self, machine: rl.Machine, shape: rl.Shape, systems: list, args):
        self.machine, self.shape, self.systems = machine, shape, systems
        self.repeats, self.hf_batches = args.repeats, args.hf_batches
        self.peak_mib: dict[str, float] = {}

    def timed(self, system, fn, *args) -> float:
        base = rl.reset_peak_rss()
        seconds = fn(*args)
        extra = rl.rss_mib("VmHWM") - base
        key = f"{system.system} {system.label}"
        self.peak_mib[key] = max(self.peak_mib.get(key, 0.0), extra)
        return seconds

    def prefill(self, prompts: Prompts, tokens: int) -> list[rl.Result]:
        samples = {s: [] for s in self.systems}  # keyed by object: labels repeat
        for _ in range(self.repeats):
            for s in self.systems:
                samples[s].append(self.timed(s, s.prefill, prompts.make(tokens)))
        return [self._result(s, "prefill", 1, tokens, samples[s]) for s in self.systems]

    def decode(self, prompts: Prompts, batch: int, context: int, steps: int) -> list[rl.Result]:
        systems = [s for s in self.systems if s.system == "pdserve" or batch in self.hf_batches]
        samples = {s: [] for s in systems}
        for _ in range(self.repeats):
            for s in systems:
                batch_prompts = [prompts.make(context) for _ in range(batch)]
                samples[s].append(self.timed(s, s.decode, batch_prompts, steps))
        mean_ctx = context + 2 + (steps - 1) / 2  # keys attended, averaged over timed steps
        return [self._result(s, "decode", batch, context, samples[s], mean_ctx) for s in systems]

    def _result(self, s, workload, batch, tokens, samples, mean_ctx=0.0) -> rl.Result:
        sec = statistics.median(samples)
        m, shape = self.machine, self.shape
        if workload == "prefill":
            roof, rate = rl.prefill_roof(m, shape, s.dtype, tokens, sec), tokens / sec
        else:  # our KV cache and transformers' are both kept in the model's dtype
            roof, rate = (
                rl.decode_roof(
                    m,
                    shape,
                    s.dtype,
                    s.dtype,
                    batch,
                    mean_ctx,
                    sec,
                    getattr(s, "weight_bytes", None),
                ),  # fmt: skip
                batch / sec,
            )
        return rl.Result(s.system, s.label, workload, batch, tokens, sec, samples, rate, roof)


def load_line() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def run(args) -> dict:
    """Load every system, run every workload, print the table and return the JSON record."""
    print(f"threads {args.threads}; {load_line()}", flush=True)
    machine = rl.measure_machine(["bfloat16", "float32"], args.threads, args.quick)
    print(f"memory bandwidth {machine.mem_bw / 1e9:.1f} GB/s (copy, read+write); matmul peak "
          + ", ".join(f"{d} {p / 1e9:.0f} GFLOP/s" for d, p in machine.matmul_peak.items()),
          flush=True)  # fmt: skip
    systems, load_mib = [], {}
    for make, dtype in [(Ours, d) for d in args.dtypes] + [(Theirs, d) for d in args.hf_dtypes]:
        before = rl.reset_peak_rss()
        system = (
            Ours(dtype, args.threads, args.kv_cache_gb, weights=args.weights,
                 enforce_eager=args.enforce_eager)
            if make is Ours else Theirs(dtype)
        )  # fmt: skip
        load_mib[f"{system.system} {system.label}"] = rl.rss_mib() - before
        systems.append(system)
    shape = rl.Shape.of(systems[0].llm.model_config)  # --dtypes is never empty
    bench = Bench(machine, shape, systems, args)
    prompts, results = Prompts(shape.vocab), []
    for n in args.prefill:
        results += bench.prefill(prompts, n)
        print(f"  prefill {n} done; {load_line()}", flush=True)
    for b in args.batches:
        results += bench.decode(prompts, b, args.context, args.decode_steps)
        print(f"  decode b={b} done; {load_line()}", flush=True)
    results.sort(key=lambda r: (r.workload != "prefill", r.tokens, r.batch, r.system, r.dtype))
    rs = rl.ratios(results)
    peak = {k: load_mib[k] + bench.peak_mib.get(k, 0.0) for k in load_mib}
    print("\n" + rl.table(results, peak) + "\n\n" + rl.ratio_lines(rs))
    print(f"\nfinished with {load_line()}; peak MiB = RSS added by loading + largest transient")
    return {
        "machine": machine._asdict(),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "results": [r._asdict() | {"roof": r.roof._asdict()} for r in results],
        "memory_mib": {"peak": peak, "load": load_mib, "transient": bench.peak_mib},
        "ratios": [r._asdict() for r in rs],
        "load_end": os.getloadavg(),
    }


def profile(args) -> None:
    """Where our engine's time goes: torch.profiler ops and cProfile Python functions, for
    steady decode at the largest of --batches and a prefill of the longest of --prefill, with the
    first of --dtypes."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ours = Ours(args.dtypes[0], args.threads, args.kv_cache_gb, weights=args.weights,
                enforce_eager=args.enforce_eager)  # fmt: skip
    prompts, eng = Prompts(ours.llm.model_config.vocab_size), ours.llm.engine
    batch, tokens = max(args.batches), max(args.prefill)
    ours.start_decode([prompts.make(args.context) for _ in range(batch)], 40)
    work = {  # decode: only steady steps of the sequences started above (40 tokens each)
        f"decode b={batch}": lambda: [eng.step() for _ in range(8)],
        f"prefill {tokens}": lambda: ours.prefill(prompts.make(tokens)),
    }
    for name, fn in work.items():
        if name.startswith("prefill"):
            for seq in list(eng.requests.values()):
                eng.abort(seq.request_id)  # the decode batch is done with
        fn()  # warm-up
        print(f"\n=== {name} ({ours.label}, {args.threads} threads, {load_line()}) ===")
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        py = cProfile.Profile()
        py.runcall(fn)
        pstats.Stats(py).sort_stats("tottime").print_stats(12)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="pdserve's engine against transformers on the bundled GGUF: prefill and "
        "decode tokens/s, peak memory (RSS) and fractions of this machine's measured roofline.",
        epilog="Figures are medians of --repeats runs, interleaved across systems in one process.",
    )
    add = p.add_argument
    # fmt: off
    add("--threads", type=int, default=1, metavar="N",
        help="torch threads for every system (default 1: on a shared, busy machine, more "
        "threads than idle cores make torch many times slower)")
    add("--quick", action="store_true",
        help="smoke run: 1 repeat, 8 decode steps, batches 1 and 16, auto vs bfloat16 only")
    add("--repeats", type=int, default=3, metavar="N", help="runs per figure (default 3)")
    add("--dtypes", nargs="+", default=["auto", "float32"], metavar="DTYPE",
        help="our dtypes (default: auto float32; auto = bfloat16 on CPUs with AVX512-BF16/AMX)")
    add("--hf-dtypes", nargs="*", default=["float32", "bfloat16"], metavar="DTYPE",
        help="transformers dtypes (default: float32 bfloat16; none given: skip transformers)")
    add("--prefill", nargs="+", type=int, default=list(PREFILL_TOKENS), metavar="T",
        help="prompt lengths to prefill (default: 512 2048)")
    add("--batches", nargs="+", type=int, default=list(DECODE_BATCHES), metavar="B",
        help="our decode batch sizes (default: 1 8 16 32)")
    add("--hf-batches", nargs="+", type=int, default=list(HF_DECODE_BATCHES), metavar="B",
        help="transformers decode batch sizes, among --batches (default: 1 16)")
    add("--context", type=int, default=128, metavar="T",
        help="prompt tokens of each sequence before decoding (default 128)")
    add("--decode-steps", type=int, default=64, metavar="N",
        help="timed decode steps per run (default 64)")
    add("--weights", default="auto", choices=WEIGHT_FORMATS,
        help="our weight format (default auto: int4 for the bundled Q4_1 GGUF)")
    add("--enforce-eager", action="store_true",
        help="our decode steps through the eager model, not the fused decode step")
    add("--kv-cache-gb", type=float, default=None, metavar="GB",
        help="our KV cache size (default: the engine's own default)")
    add("--out", type=Path, default=None, metavar="FILE", help="also write the results as JSON")
    add("--profile", action="store_true",
        help="instead of comparing: profile our engine (first of --dtypes) at decode of the "
        "largest of --batches and prefill of the longest of --prefill, with torch.profiler and "
        "cProfile")
    # fmt: on
    if "--quick" in (argv if argv is not None else sys.argv[1:]):  # explicit flags still win
        p.set_defaults(repeats=1, decode_steps=8, batches=[1, 16], dtypes=["auto"],
                       hf_dtypes=["bfloat16"])  # fmt: skip
    args = p.parse_args(argv)
    if args.threads < 1 or args.repeats < 1 or args.decode_steps < 1 or not args.dtypes:
        p.error("--threads, --repeats and --decode-steps must be >= 1, --dtypes non-empty")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.profile:
        profile(args)
        return 0
    record = run(args)
    if args.out:
        args.out.write_text(json.dumps(record, indent=2, default=str))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
