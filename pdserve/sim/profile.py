"""`pdserve profile`: time the real engine over a grid and fit the latency model's efficiencies.

Prefill of B prompts of P tokens is timed as `generate(..., max_tokens=1)`; one decode step at
batch B as (time of max_tokens=N+1 - time of max_tokens=1) / N. Every call uses fresh token ids
so the engine's prefix cache never turns a prefill into a cache hit. Each point is the median of
`repeats` timings (decode: of the differences of back-to-back pairs): what a step typically
costs, which is what the served engine sees, unmoved by one disturbed timing. The repeats are
taken in rounds over the whole grid, not back to back, so that each point is sampled across
the profile's whole run: on a VM whose speed drifts between modes (the two-thread engine here
decodes at ~37 or ~50 ms per step, switching within seconds) a slow stretch then shifts every
point's samples alike instead of deciding a few points outright. The grids reach
the lengths and batches a mixed workload does (prompts to 3k tokens, batches to 16, a 2k-token
context), because the fit extrapolates poorly: fitted on prompts up to 512 tokens it put a
3k-token prefill at 2.5x its measured time. The fit chooses `mfu` and `mbu` on a log grid and
the overheads by least squares, minimising relative error.

The engine is passed in (anything with `generate(prompts, params)` and `model_config`), so the
fit is tested with a fake engine; the CLI builds the real `pdserve.LLM`.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pdserve.sim.hardware import Accelerator
from pdserve.sim.kvmath import kv_dtype_of
from pdserve.sim.latency import Batch, Efficiency, LatencyModel
from pdserve.sim.models import ModelSpec, from_engine_config

PROFILE_VERSION = 1
DEFAULT_PREFILL = ((1, 32), (1, 128), (1, 512), (4, 128), (1, 2048), (1, 3072))  # (batch, tokens)
DEFAULT_DECODE = ((1, 64), (2, 64), (4, 64), (8, 64), (16, 64), (4, 256), (1, 2048))  # (batch, ctx)
DEFAULT_DECODE_STEPS = 32  # enough decode time to stand out of the noise of a 2k-token prefill


class Point(NamedTuple):
    """One measurement: `seconds` for one forward pass over `batch` (per step for decode)."""

    phase: str
    batch_size: int
    tokens: int
    seconds: float


def point_batch(p: Point, decode_steps: int) -> Batch:
    """The aggregate Batch a measurement ran (decode: its average context over the steps)."""
    b, n = p.batch_size, p.tokens
    if p.phase == "prefill":
        return Batch(b * n, b, b * n * n / 2, 0, b)
    ctx = n + (decode_steps + 1) / 2  # steps run at contexts n+1 .. n+decode_steps
    return Batch(b, b, b * ctx, b * ctx, b)


class _Prompts:
    """Distinct token-id prompts, so repeated calls never hit the prefix cache."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab = max(vocab_size - 16, 2)
        self.counter = itertools.count(1)

    def make(self, batch: int, length: int) -> list[list[int]]:
        base = next(self.counter) * 7919
        return [
            [(base + 31 * b + 17 * i) % self.vocab + 8 for i in range(length)] for b in range(batch)
        ]


def measure_engine(
    llm: Any,
    sampling_params: Callable[[int], Any],
    prefill_grid: Sequence[tuple[int, int]] = DEFAULT_PREFILL,
    decode_grid: Sequence[tuple[int, int]] = DEFAULT_DECODE,
    decode_steps: int = DEFAULT_DECODE_STEPS,
    clock: Callable[[], float] = time.perf_counter,
    repeats: int = 1,
) -> list[Point]:
    """Time `llm` over the grids; `sampling_params(n)` builds greedy params for n tokens.

    Each point is the median of `repeats` timings (decode: of back-to-back differences), taken
    in `repeats` rounds over the whole grid.
    """
    prompts = _Prompts(llm.model_config.vocab_size)

    def once(batch: int, length: int, max_tokens: int) -> float:
        ids = prompts.make(batch, length)
        start = clock()
        llm.generate(ids, sampling_params(max_tokens))
        return clock() - start

    def sample(phase: str, batch: int, length: int) -> float:
        if phase == "prefill":
            return once(batch, length, 1)
        return (once(batch, length, decode_steps + 1) - once(batch, length, 1)) / decode_steps

    grid = [("prefill", b, n) for b, n in prefill_grid] + [("decode", b, n) for b, n in decode_grid]
    once(1, 16, 2)  # warm-up: first-call allocations and lazy initialisation
    samples: dict[tuple[str, int, int], list[float]] = {g: [] for g in grid}
    for _ in range(repeats):
        for g in grid:
            samples[g].append(sample(*g))
    return [Point(*g, max(statistics.median(samples[g]), 1e-9)) for g in grid]


class Fit(NamedTuple):
    """Fitted efficiencies and how well they reproduce the measurements."""

    efficiency: Efficiency
    median_rel_error: float
    max_rel_error: float


EFF_GRID = tuple(float(x) for x in (0.01 * 100 ** (i / 29) for i in range(30)))  # 0.01..1
HALF_TOKENS_GRID = (0.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)


def fit_efficiency(
    points: Sequence[Point], model: ModelSpec, accel: Accelerator, weight_dtype: str,
    decode_steps: int = DEFAULT_DECODE_STEPS,
) -> Fit:  # fmt: skip
    """Fit `points` with the latency model (see `fit_batches`). Needs >= 2 points."""
    if len(points) < 2:
        raise ValueError("profiling needs at least 2 measurements to fit; add grid points")
    batches = [point_batch(p, decode_steps) for p in points]
    return fit_batches(batches, [p.seconds for p in points], model, accel, weight_dtype)


def fit_batches(
    batches: Sequence[Batch], seconds: Sequence[float], model: ModelSpec, accel: Accelerator,
    weight_dtype: str, weights: Sequence[float] | None = None,
) -> Fit:  # fmt: skip
    """Fit the latency model to passes over `batches` that took `seconds`, minimising relative
    squared error (each pass's times its weight, default 1).

    mfu, mbu and half_tokens are searched on grids, then on a grid 8x finer around the best;
    for each, the overheads (per pass, per sequence, per cached token read) and the attention
    cost, which enter linearly, are solved by non-negative least squares (attention at no more
    than peak FLOP/s: its cost is solved as the excess over that).
    """
    import numpy as np

    unit = raw_work_model(model, accel, weight_dtype)
    work = np.array([unit.work(b) for b in batches])
    gemm, attn = work[:, 0] / accel.peak_flops, work[:, 1] / accel.peak_flops
    mem = work[:, 2] / accel.mem_bytes_per_s
    tokens = np.array([b.tokens for b in batches], dtype=np.float64)
    seqs = np.array([b.seqs for b in batches], dtype=np.float64)
    cached = np.array([b.kv_read for b in batches], dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    w = np.sqrt(np.ones_like(t) if weights is None else np.asarray(weights, dtype=np.float64))
    scale = w / t
    linear = np.stack([np.ones_like(t), seqs, attn, cached], axis=1) * scale[:, None]

    def search(mfus, halves, mbus, best):
        for mfu, half, mbu in itertools.product(mfus, halves, mbus):
            roof = np.maximum(gemm / mfu * (1 + half / tokens), mem / mbu)
            coef, err = nonneg_lstsq(linear, (t - roof - attn) * scale)
            if err < best[0]:
                over, per_seq, attn_excess, per_cached = coef
                eff = Efficiency(mfu, mbu, over, per_seq, 1 / (1 + attn_excess), half, per_cached)
                best = (err, eff)
        return best

    best = search(EFF_GRID, HALF_TOKENS_GRID, EFF_GRID, (math.inf, Efficiency()))
    e = best[1]
    best = search(_finer(e.mfu), (e.half_tokens,), _finer(e.mbu), best)
    eff = best[1]
    fitted = LatencyModel(model, accel, 1, eff, weight_dtype, kv_dtype_of(weight_dtype))
    rel = np.abs(np.array([fitted.iteration(b) for b in batches]) / t - 1)
    return Fit(eff, float(np.median(rel)), float(rel.max()))


def raw_work_model(model: ModelSpec, accel: Accelerator, weight_dtype: str) -> LatencyModel:
    """A latency model at full efficiency and no overheads: its `work` is a pass's raw FLOPs
    and bytes, which the fits divide by the peaks."""
    unit = Efficiency(1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0)
    return LatencyModel(model, accel, 1, unit, weight_dtype, kv_dtype_of(weight_dtype))


def _finer(x: float) -> list[float]:
    """Values within one step of EFF_GRID around `x`, 8 to a step, capped at 1."""
    step = EFF_GRID[1] / EFF_GRID[0]
    return sorted({min(1.0, x * step ** (k / 8)) for k in range(-8, 9)})


def nonneg_lstsq(a, y) -> tuple[list[float], float]:
    """Least squares with every coefficient >= 0, for a few columns: the unconstrained
    solution when it is feasible (then it is optimal), else the best over column subsets."""
    import numpy as np

    cols = a.shape[1]
    best: tuple[list[float], float] = ([0.0] * cols, float(y @ y))
    for r in range(cols, 0, -1):
        for subset in itertools.combinations(range(cols), r):
            sol, *_ = np.linalg.lstsq(a[:, subset], y, rcond=None)
            if (sol < 0).any():
                continue
            resid = y - a[:, subset] @ sol
            err = float(resid @ resid)
            if err < best[1]:
                coef = [0.0] * cols
                for k, v in zip(subset, sol, strict=True):
                    coef[k] = float(v)
                best = (coef, err)
            if r == cols:
                return best
    return best


def engine_profile(
    model: str | None, dtype: str, threads: int | None, accel: Accelerator,
    prefill_grid: Sequence[tuple[int, int]], decode_grid: Sequence[tuple[int, int]],
    decode_steps: int, repeats: int = 1, weights: str = "auto",
) -> tuple[list[Point], ModelSpec, str, Fit]:  # fmt: skip
    """Build the real engine, time it and fit: (points, model shape, weight dtype, fit).

    With `weights` int8 or int4 given, the weight dtype is that format (the bytes a decode
    step of few sequences reads; prefills compute on the dense copy, which the fitted
    efficiency absorbs); with auto it is the compute dtype, as profiles always had."""
    from pdserve import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, num_threads=threads, weights=weights)
    resolved = str(getattr(getattr(llm.engine, "runner", None), "dtype", dtype))
    weight_dtype = "bf16" if "bfloat16" in resolved else "fp16" if "float16" in resolved else "fp32"
    if weights in ("int8", "int4"):
        weight_dtype = weights
    params = lambda n: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
    points = measure_engine(llm, params, prefill_grid, decode_grid, decode_steps, repeats=repeats)
    spec = from_engine_config(llm.model_config, name=model or "smollm2-135m")
    return (
        points,
        spec,
        weight_dtype,
        fit_efficiency(points, spec, accel, weight_dtype, decode_steps),
    )
