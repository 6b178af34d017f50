"""Calibration from a served engine's own steps (`pdserve profile --from-steps DIR`).

`pdserve profile` times the bare engine in a process of its own. On a machine whose speed
drifts (this 2-core VM ran the same one-thread decode at 74 ms per step in one profile and
53 ms in another, minutes apart), that says little about the engine as it serves later, beside
the router, the client and the other worker. Workers started with `pdserve serve --step-log
DIR` log every step (`pdserve.engine.step_perf.StepLog`); this module fits the latency model to
those steps, so the simulator runs at the speed the engine actually had while serving:

* `read_steps` loads the logs (optionally only the steps inside or outside time windows);
* `fit_steps` groups steps of like shape (prefill or not, sequences, new tokens, cached tokens,
  on log-spaced buckets), takes each group's mean time and fits `Efficiency` to the groups,
  each weighed alike, as the profile fits its grid. The mean, not the median: a served step is
  now and then much slower (on 2 cores the router and the client take a core from a two-thread
  engine, whose other thread then spins at the barrier), and streams wait for those too;
* `step_gaps` measures the worker's loop between two decode steps (receiving messages,
  sending tokens, heartbeats): the serving overhead per step and per sequence, as
  `pdserve.sim.deployment.ServingOverhead` carries it;
* `refit_profile` rewrites a profile's efficiencies to fit the logged steps (what `pdserve
  profile --from-steps` does, and the benchmarks that calibrate from a served run).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from pdserve.sim.calibration import load_profile, save_served_fit
from pdserve.sim.hardware import Accelerator
from pdserve.sim.latency import Batch
from pdserve.sim.models import ModelSpec
from pdserve.sim.profile import Fit, fit_batches, nonneg_lstsq, raw_work_model

MAX_GAP_S = 0.25  # longer between two decode steps: the worker waited for something, not busy
MIN_STEPS = 20  # fewer steps than this cannot calibrate anything
HEADROOM = 2.0  # peaks at least this many times what any served step achieved


class Step(NamedTuple):
    """One logged engine step: started at `t` (Unix s), took `seconds`, computed `batch`."""

    log: str  # file name: one engine process
    t: float
    seconds: float
    batch: Batch
    prefill_tokens: int

    @property
    def decodes(self) -> bool:
        return self.batch.tokens > self.prefill_tokens


Window = tuple[float, float]  # [start, end) in Unix seconds


def read_steps(
    directory: str | Path, inside: Sequence[Window] = (), outside: Sequence[Window] = ()
) -> list[Step]:
    """Every step logged under `directory` (files steps-*.jsonl), in time order per log; only
    those starting inside one of `inside` (when given) and in none of `outside`."""
    files = sorted(Path(directory).glob("steps-*.jsonl"))
    if not files:
        raise ValueError(
            f"no step logs (steps-*.jsonl) in {str(directory)!r}: start the server with "
            "`pdserve serve --step-log DIR` (or PDSERVE_STEP_LOG=DIR) and send it requests"
        )
    steps = []
    for f in files:
        lines = f.read_text().splitlines()
        for n, line in enumerate(lines, 1):
            try:
                r = json.loads(line)
                batch = Batch(r["tokens"], r["sampled"], r["pairs"], r["kv_read"], r["seqs"])
                step = Step(f.name, r["t"], r["s"], batch, r["prefill_tokens"])
            except (ValueError, KeyError, TypeError) as exc:
                if n == len(lines):  # a worker killed mid-line: skip the torn tail
                    continue
                raise ValueError(f"{f}:{n} is not a step record ({exc})") from None
            if _within(step.t, inside, outside):
                steps.append(step)
    return sorted(steps, key=lambda s: (s.log, s.t))


def _within(t: float, inside: Sequence[Window], outside: Sequence[Window]) -> bool:
    if inside and not any(a <= t < b for a, b in inside):
        return False
    return not any(a <= t < b for a, b in outside)


class StepGroup(NamedTuple):
    """Logged steps of like shape, merged."""

    prefill: bool  # its steps computed prompt tokens
    batch: Batch  # their mean
    seconds: float  # their mean
    steps: int


def group_steps(steps: Iterable[Step]) -> list[StepGroup]:
    """Steps of like shape merged, one `StepGroup` per shape."""
    groups: dict[tuple, list[Step]] = defaultdict(list)
    for s in steps:
        b = s.batch
        key = (s.prefill_tokens > 0, b.seqs, _bucket(b.tokens, 1.25), _bucket(b.kv_read, 1.3))
        groups[key].append(s)
    out = []
    for key, members in groups.items():
        columns = zip(*(m.batch for m in members), strict=True)
        mean = Batch(*(statistics.fmean(col) for col in columns))
        out.append(StepGroup(key[0], mean, statistics.fmean(m.seconds for m in members),
                             len(members)))  # fmt: skip
    return out


def _bucket(x: float, factor: float) -> int:
    return round(math.log(x + 1) / math.log(factor))


def fit_steps(
    steps: Sequence[Step], model: ModelSpec, accel: Accelerator, weight_dtype: str
) -> tuple[Fit, Accelerator]:
    """The latency model's efficiencies fitted to served `steps` (see the module doc), and the
    accelerator they are fractions of: `accel`, with its peaks raised where the steps show
    them too low (`served_accelerator`)."""
    if len(steps) < MIN_STEPS:
        raise ValueError(
            f"only {len(steps)} logged steps; calibrating needs at least {MIN_STEPS} (serve "
            "some requests with prefill and decode first)"
        )
    groups = group_steps(steps)
    if len(groups) < 2:
        raise ValueError("the logged steps all have one shape; serve varied requests first")
    # Steps with prompt tokens and pure decode steps weigh alike in total, however many shapes
    # each has: decode steps come in many more shapes (batch x context), and would otherwise
    # leave the prefills, which make TTFT, to a poor fit.
    prefill = [g.prefill for g in groups]
    shares = {p: 1.0 / prefill.count(p) for p in set(prefill)}
    accel = served_accelerator(steps, model, accel, weight_dtype)
    fit = fit_batches([g.batch for g in groups], [g.seconds for g in groups], model, accel,
                      weight_dtype, [shares[p] for p in prefill])  # fmt: skip
    return fit, accel


def refit_profile(
    path: str | Path, steps_dir: str | Path, inside: Sequence[Window] = ()
) -> tuple[Fit, int]:
    """Refit the profile at `path` (written by `pdserve profile`) in place to the steps logged
    under `steps_dir` (those inside `inside`, when given); returns the fit and its steps."""
    prof = load_profile(path)
    steps = read_steps(steps_dir, inside=inside)
    fit, accel = fit_steps(steps, prof.model, prof.accelerator, prof.weight_dtype)
    save_served_fit(path, fit, accel, len(steps), str(steps_dir))
    return fit, len(steps)


def served_accelerator(
    steps: Sequence[Step], model: ModelSpec, accel: Accelerator, weight_dtype: str
) -> Accelerator:
    """`accel` with its peak FLOP/s and memory bandwidth raised, where needed, to HEADROOM times
    the most any logged step achieved. The profile measures them with a few short matmuls and
    copies, which on a drifting VM can land in a slow moment (this machine's two-thread "peak"
    read 204 GFLOP/s in one profile and 395 in another); efficiencies are fractions of the
    peaks, capped at 1, so a peak measured low leaves the fit pinned at the cap and distorts it
    (long prefills came out 15-40 % slow)."""
    unit = raw_work_model(model, accel, weight_dtype)
    flops = bytes_ = 0.0
    for s in steps:
        w = unit.work(s.batch)
        flops = max(flops, (w.gemm_flops + w.attn_flops) / s.seconds)
        bytes_ = max(bytes_, w.bytes / s.seconds)
    return replace(accel, peak_flops=max(accel.peak_flops, HEADROOM * flops),
                   mem_bytes_per_s=max(accel.mem_bytes_per_s, HEADROOM * bytes_))  # fmt: skip


def step_gaps(steps: Sequence[Step]) -> tuple[float, float]:
    """(seconds per step, seconds per sequence) the worker spends between two consecutive
    decode steps, fitted (non-negative least squares) to the gaps of back-to-back decode steps;
    (0, 0) when none were logged."""
    import numpy as np

    rows = []
    for a, b in itertools.pairwise(steps):
        gap = b.t - (a.t + a.seconds)
        if a.log == b.log and a.decodes and b.decodes and 0 <= gap < MAX_GAP_S:
            rows.append((a.batch.seqs, gap))  # the loop sends the tokens of the step just done
    if not rows:
        return 0.0, 0.0
    data = np.array(rows, dtype=np.float64)
    (step, seq), _ = nonneg_lstsq(np.stack([np.ones(len(data)), data[:, 0]], axis=1), data[:, 1])
    return step, seq
