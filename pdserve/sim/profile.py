"""`pdserve profile`: time the real engine over a grid and fit the latency model's efficiencies.

Prefill of B prompts of P tokens is timed as `generate(..., max_tokens=1)`; one decode step at
batch B as (time of max_tokens=N+1 - time of max_tokens=1) / N. Every call uses fresh token ids
so the engine's prefix cache never turns a prefill into a cache hit. The fit chooses `mfu` and
`mbu` on a log grid and the overheads by least squares, minimising relative error.

The engine is passed in (anything with `generate(prompts, params)` and `model_config`), so the
fit is tested with a fake engine; the CLI builds the real `pdserve.LLM`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pdserve.sim.hardware import Accelerator
from pdserve.sim.latency import Batch, Efficiency, LatencyModel
from pdserve.sim.models import ModelSpec, from_engine_config

PROFILE_VERSION = 1
DEFAULT_PREFILL = ((1, 32), (1, 128), (1, 512), (4, 128))  # (batch, prompt tokens)
DEFAULT_DECODE = ((1, 64), (4, 64), (16, 64), (4, 512))  # (batch, context tokens)


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
    decode_steps: int = 8,
    clock: Callable[[], float] = time.perf_counter,
) -> list[Point]:
    """Time `llm` over the grids; `sampling_params(n)` builds greedy params for n tokens."""
    prompts = _Prompts(llm.model_config.vocab_size)

    def run(batch: int, length: int, max_tokens: int) -> float:
        ids = prompts.make(batch, length)
        start = clock()
        llm.generate(ids, sampling_params(max_tokens))
        return clock() - start

    run(1, 16, 2)  # warm-up: first-call allocations and lazy initialisation
    points = [Point("prefill", b, n, run(b, n, 1)) for b, n in prefill_grid]
    for b, n in decode_grid:
        steps = (run(b, n, decode_steps + 1) - run(b, n, 1)) / decode_steps
        points.append(Point("decode", b, n, max(steps, 1e-9)))
    return points


class Fit(NamedTuple):
    """Fitted efficiencies and how well they reproduce the measurements."""

    efficiency: Efficiency
    median_rel_error: float
    max_rel_error: float


def fit_efficiency(
    points: Sequence[Point], model: ModelSpec, accel: Accelerator, weight_dtype: str,
    decode_steps: int = 8,
) -> Fit:  # fmt: skip
    """Least-relative-error fit of mfu, mbu and overheads to `points` (needs >= 2 points)."""
    import numpy as np

    if len(points) < 2:
        raise ValueError("profiling needs at least 2 measurements to fit; add grid points")
    unit = LatencyModel(model, accel, 1, Efficiency(1.0, 1.0, 0.0, 0.0), weight_dtype, weight_dtype)
    batches = [point_batch(p, decode_steps) for p in points]
    compute = np.array([_roofline_parts(unit, b)[0] for b in batches])
    memory = np.array([_roofline_parts(unit, b)[1] for b in batches])
    seqs = np.array([b.seqs for b in batches], dtype=np.float64)
    t = np.array([p.seconds for p in points])
    best: tuple[float, Efficiency] | None = None
    grid = np.geomspace(0.005, 1.0, 80)
    for mfu in grid:
        for mbu in grid:
            roof = np.maximum(compute / mfu, memory / mbu)
            over, per_seq = _fit_overheads(t - roof, seqs, t)
            pred = roof + over + per_seq * seqs
            err = float(np.sum(((pred - t) / t) ** 2))
            if best is None or err < best[0]:
                best = (err, Efficiency(float(mfu), float(mbu), over, per_seq))
    eff = best[1]
    rel = np.abs(np.array([LatencyModel(model, accel, 1, eff, weight_dtype, weight_dtype)
                           .iteration(b) for b in batches]) / t - 1)  # fmt: skip
    return Fit(eff, float(np.median(rel)), float(rel.max()))


def _roofline_parts(unit: LatencyModel, batch: Batch) -> tuple[float, float]:
    """(compute seconds, memory seconds) at 100 % efficiency and no overhead."""
    flops, mem = unit.work(batch)
    return flops / unit.accel.peak_flops, mem / unit.accel.mem_bytes_per_s


def _fit_overheads(resid, seqs, t) -> tuple[float, float]:
    """Non-negative (overhead, per-seq overhead) minimising relative squared error."""
    import numpy as np

    w = 1.0 / t
    a = np.stack([w, w * seqs], axis=1)
    sol, *_ = np.linalg.lstsq(a, resid * w, rcond=None)
    over, per_seq = float(sol[0]), float(sol[1])
    if over < 0 or per_seq < 0:  # refit with the offending term pinned at zero
        over = max(0.0, float(np.sum(resid * w * w) / np.sum(w * w)))
        per_seq = 0.0
    return over, per_seq


def engine_profile(
    model: str | None, dtype: str, threads: int | None, accel: Accelerator,
    prefill_grid: Sequence[tuple[int, int]], decode_grid: Sequence[tuple[int, int]],
    decode_steps: int,
) -> tuple[list[Point], ModelSpec, str, Fit]:  # fmt: skip
    """Build the real engine, time it and fit: (points, model shape, weight dtype, fit)."""
    from pdserve import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, num_threads=threads)
    resolved = str(getattr(getattr(llm.engine, "runner", None), "dtype", dtype))
    weight_dtype = "bf16" if "bfloat16" in resolved else "fp16" if "float16" in resolved else "fp32"
    params = lambda n: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
    points = measure_engine(llm, params, prefill_grid, decode_grid, decode_steps)
    spec = from_engine_config(llm.model_config, name=model or "smollm2-135m")
    return (
        points,
        spec,
        weight_dtype,
        fit_efficiency(points, spec, accel, weight_dtype, decode_steps),
    )
