"""This machine's roofline, the work a Llama-family forward pass does, and the report that puts
benchmarks/engine.py's figures against them.

The machine is measured, not looked up: memory bandwidth with a large torch copy (bytes read +
bytes written, best of the repeats) and the matmul peak with a large square torch matmul in each
dtype (best of the repeats), both with the thread count the benchmark runs with.

Work accounting (per forward pass; `matmul params` = every projection of every layer, without
the embedding table, whose rows are gathered, not multiplied):

* prefill FLOPs = 2 * matmul params * T  +  2 * hidden * vocab (logits of the last token only)
  +  attention 2 * layers * heads * head_dim * T^2 (QK^T and PV, causal: half of the square);
* decode bytes per step = every weight read once (projections, norms, and the vocab x hidden
  lm_head matrix, tied or not)  +  the K and V of every context token of every sequence;
* decode FLOPs per step = batch * (2 * (matmul params + hidden * vocab)
  +  4 * layers * heads * head_dim * context).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import NamedTuple

import torch


class Machine(NamedTuple):
    """Measured limits: `mem_bw` in bytes/s, `matmul_peak` in FLOP/s per dtype name."""

    threads: int
    mem_bw: float
    matmul_peak: dict[str, float]


class Shape(NamedTuple):
    """The counts of a Llama-family model that the accounting needs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, cfg) -> Shape:
        """From a `pdserve.config.ModelConfig`."""
        return cls(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)  # fmt: skip

    @property
    def matmul_params(self) -> int:
        qkvo = self.hidden * (2 * self.heads + 2 * self.kv_heads) * self.head_dim
        return self.layers * (qkvo + 3 * self.hidden * self.intermediate)

    @property
    def weight_params_read_per_step(self) -> int:
        """Projections, the lm_head matrix and the norm weights: what one decode step reads."""
        norms = (2 * self.layers + 1) * self.hidden
        return self.matmul_params + self.vocab * self.hidden + norms

    @property
    def kv_elems_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim


def prefill_flops(s: Shape, tokens: int) -> float:
    """FLOPs of one prefill of `tokens` tokens (one sequence, logits of the last token)."""
    attention = 2 * s.layers * s.heads * s.head_dim * tokens * tokens
    return 2 * s.matmul_params * tokens + 2 * s.hidden * s.vocab + attention


def decode_bytes(s: Shape, weight_bytes: int, kv_bytes: int, batch: int, context: float) -> float:
    """Bytes one decode step reads: weights once plus the KV of `batch` x `context` tokens."""
    return (
        s.weight_params_read_per_step * weight_bytes
        + batch * context * s.kv_elems_per_token * kv_bytes
    )


def decode_flops(s: Shape, batch: int, context: float) -> float:
    """FLOPs of one decode step of `batch` sequences at mean context length `context`."""
    per_token = 2 * (s.matmul_params + s.hidden * s.vocab)
    return batch * (per_token + 4 * s.layers * s.heads * s.head_dim * context)


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy, counting the bytes read and the bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), repeats)


def measure_matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of an n x n x n torch matmul in `dtype`."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b, repeats)


def measure_machine(dtypes: list[str], threads: int, quick: bool = False) -> Machine:
    """Measure bandwidth and the matmul peak of each dtype with `threads` torch threads."""
    torch.set_num_threads(threads)
    repeats = 2 if quick else 5
    peaks = {d: measure_matmul_peak(getattr(torch, d), repeats=repeats) for d in dtypes}
    return Machine(threads, measure_bandwidth(repeats=repeats), peaks)


def dtype_bytes(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


class Roof(NamedTuple):
    """Achieved rates and their fractions of the roofline (None where not meaningful)."""

    flops_per_s: float
    bytes_per_s: float | None
    compute_fraction: float
    memory_fraction: float | None

    @property
    def bound_fraction(self) -> float:
        """Fraction of the nearer roof: the ideal time max(FLOPs/peak, bytes/bw) / measured."""
        return max(self.compute_fraction, self.memory_fraction or 0.0)


def prefill_roof(m: Machine, s: Shape, dtype: str, tokens: int, seconds: float) -> Roof:
    flops = prefill_flops(s, tokens) / seconds
    return Roof(flops, None, flops / m.matmul_peak[dtype], None)


def decode_roof(
    m: Machine,
    s: Shape,
    dtype: str,
    kv_dtype: str,
    batch: int,
    context: float,
    step_s: float,
    weight_bytes: int | None = None,
) -> Roof:
    """Roofline of one decode step of `step_s` seconds (`context`: mean keys per sequence).
    `weight_bytes`: what the step's weights really take (quantized formats), if not `dtype`'s
    size per parameter."""
    per_param = (
        dtype_bytes(dtype) if weight_bytes is None else weight_bytes / s.weight_params_read_per_step
    )
    nbytes = decode_bytes(s, per_param, dtype_bytes(kv_dtype), batch, context) / step_s
    flops = decode_flops(s, batch, context) / step_s
    return Roof(flops, nbytes, flops / m.matmul_peak[dtype], nbytes / m.mem_bw)


class Result(NamedTuple):
    system: str
    dtype: str
    workload: str  # "prefill" | "decode"
    batch: int
    tokens: int  # prompt tokens (prefill) or prompt tokens before decoding (decode)
    seconds: float  # median: the whole prefill, or one decode step
    samples: list[float]
    tokens_per_s: float
    roof: Roof


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:5.1f}%"


def table(results: list[Result], peak_mib: dict[str, float]) -> str:
    """One row per result; `peak_mib` keyed by "system dtype-label"."""
    head = (
        f"{'system':<13}{'dtype':<26}{'workload':<17}{'tokens/s':>10}{'median':>11}"
        f"{'GFLOP/s':>9}{'GB/s':>7}{'%peak':>8}{'%bw':>8}{'%roof':>8}  peak MiB"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        what = f"prefill {r.tokens}" if r.workload == "prefill" else f"decode b={r.batch}"
        unit = "s" if r.workload == "prefill" else "ms"
        sec = r.seconds if unit == "s" else r.seconds * 1e3
        bw = "-" if r.roof.bytes_per_s is None else f"{r.roof.bytes_per_s / 1e9:.1f}"
        mem = peak_mib[f"{r.system} {r.dtype}"]
        lines.append(
            f"{r.system:<13}{r.dtype:<26}{what:<17}{r.tokens_per_s:>10.1f}{sec:>9.3f}{unit:<2}"
            f"{r.roof.flops_per_s / 1e9:>9.1f}{bw:>7}{_pct(r.roof.compute_fraction):>8}"
            f"{_pct(r.roof.memory_fraction):>8}{_pct(r.roof.bound_fraction):>8}  {mem:8.0f}"
        )
    return "\n".join(lines)


class Ratio(NamedTuple):
    what: str
    ours: str
    theirs: str
    ratio: float
    target: float


def ratios(results: list[Result]) -> list[Ratio]:
    """Targets of issue 2, for every pairing of our dtypes with theirs, fastest pair first."""

    def pick(system, workload, batch, tokens=None):
        return [r for r in results if (r.system, r.workload, r.batch) == (system, workload, batch)
                and tokens in (None, r.tokens)]  # fmt: skip

    out = []
    for o in pick("pdserve", "prefill", 1, 2048):
        for t in pick("transformers", "prefill", 1, 2048):
            out.append(Ratio("prefill 2048 tokens", o.dtype, t.dtype, t.seconds / o.seconds, 2))
    for o in pick("pdserve", "decode", 16):
        for t in pick("transformers", "decode", 1):
            r = o.tokens_per_s / t.tokens_per_s
            out.append(Ratio("decode: ours b=16 / theirs b=1", o.dtype, t.dtype, r, 5))
        for t in pick("transformers", "decode", 16):
            r = o.tokens_per_s / t.tokens_per_s
            out.append(Ratio("decode: ours b=16 / theirs b=16", o.dtype, t.dtype, r, 0))
    return out


def ratio_lines(rs: list[Ratio]) -> str:
    """One line per ratio, with its verdict where issue 2 sets a target."""
    lines = []
    for r in rs:
        verdict = "" if not r.target else ("  meets" if r.ratio >= r.target else "  MISSES")
        target = f" (target >= {r.target}x)" if r.target else ""
        lines.append(
            f"{r.what:<32} {r.ours:<26} vs {r.theirs:<26} {r.ratio:6.2f}x{target}{verdict}"
        )
    return "\n".join(lines)


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS) or its peak since the last reset (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")  # not Linux


def reset_peak_rss() -> float:
    """Reset the kernel's peak-RSS mark (clear_refs 5); return the current RSS in MiB."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or not allowed: peaks then include everything before
    return rss_mib()
