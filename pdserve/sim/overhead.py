"""Serving overhead: what the served path adds to the bare engine that `pdserve profile` times.

The profile times `LLM.generate` alone. A served request also crosses the HTTP server, the
router (tokenization, placement, detokenization), ZeroMQ hops to and from the worker
(disaggregated: router -> D -> router -> P -> router -> D) and bench's client; every engine
step shares its worker's loop with messages and heartbeat snapshots, and every streamed token
costs detokenization, an SSE event and the client's parsing, on the same cores as the engine.
Three numbers per mode describe that, all >= 0 (`ServingOverhead`, in deployment.py: a
`Cluster` holds one per mode):

* `request_s`, once per request: in the simulator a request reaches an instance this long
  after it was sent (its TTFT still counts from the send);
* `step_s`, once per engine iteration, and `seq_s`, once per sequence in it: they lengthen
  the instance's steps, so they enter TPOT once per token and slow everything batched.

The probes (`probe_groups`) are small groups of short requests sent together (1, 4, 1 and 8
at once, three rounds) to an idle server by `measure_probes`, with bench's own client and
prompts. `fit_overhead` simulates each group alone on the calibrated cluster and fits the
excess of measured over predicted TPOT (medians per group size) as step_s and seq_s times
their slopes (how much each adds to a request's TPOT, found by simulating 1 ms of each: about
1 and the batch it decoded in); `request_s` is the median excess of TTFT of the lone requests
once step_s and seq_s are in the prediction. Prompts are short so that the engine model's own
error on long prefills is not mistaken for overhead.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from pdserve.bench.metrics import SLO, RequestRecord
from pdserve.bench.workload import RequestSpec
from pdserve.sim.deployment import ServingOverhead
from pdserve.sim.simulator import simulate

PROBE_PROMPTS = (32, 128, 224)  # tokens; below the router's 256-token local threshold
PROBE_OUTPUT = 32  # tokens: 31 inter-token gaps per request
PROBE_SIZES = (1, 4, 1, 8)  # requests sent together; lone ones twice, for request_s
PROBE_REPEATS = 3


class OverheadFit(NamedTuple):
    """The fitted overhead, and the raw TTFT excess of a lone request and TPOT excess per group
    size it came from (negative: the server was faster than the bare-engine prediction, so the
    profile is too slow)."""

    overhead: ServingOverhead
    raw_request_s: float
    raw_tpot_s: dict[int, float]  # by group size
    probes: int


def probe_groups(
    sizes: Sequence[int] = PROBE_SIZES, prompts: Sequence[int] = PROBE_PROMPTS,
    output: int = PROBE_OUTPUT, repeats: int = PROBE_REPEATS,
) -> list[list[RequestSpec]]:  # fmt: skip
    """Groups of requests to send together: a lone warm-up (`measure_probes` drops it), then
    every size `repeats` times, interleaved so slow drift on the machine touches each alike.
    Prompt lengths cycle through `prompts`; indexes are unique over all groups."""
    index, lengths = itertools.count(), itertools.cycle(prompts)
    return [
        [RequestSpec(next(index), 0.0, "probe", next(lengths), output) for _ in range(k)]
        for k in (1, *(k for _ in range(repeats) for k in sizes))
    ]


# A document's prefill beside running streams, with short prompts arriving meanwhile: in
# (arrival s, prompt tokens, output tokens). Disaggregated, the prefill worker computes the
# document while the decode worker prefills the late short prompts itself, in chunks beside its
# streams; co-located, one worker prefills the document beside its streams. Such steps are
# common only at high load, so a calibration that leaves out the busiest rate has few of them
# unless these rounds put them in.
INTERFERENCE_ROUND = (
    (0.0, 96, 96), (0.0, 160, 96), (0.0, 224, 96), (0.0, 64, 96),
    (0.5, 3072, 8),
    (1.5, 128, 48), (2.5, 192, 48), (3.5, 224, 48), (4.5, 160, 48),
)  # fmt: skip
INTERFERENCE_ROUNDS = 2


def interference_rounds(
    rounds: int = INTERFERENCE_ROUNDS, shape: Sequence[tuple[float, int, int]] = INTERFERENCE_ROUND
) -> list[list[RequestSpec]]:
    """`rounds` copies of `shape`, each a group for `measure_probes` (arrivals within the
    round). Their steps calibrate the engine model (`pdserve.sim.served`); they are not
    probes for `fit_overhead`, which wants short requests on an idle server."""
    index = itertools.count(10_000)  # apart from probe_groups' indexes
    return [
        [RequestSpec(next(index), t, "interference", p, o) for t, p, o in shape]
        for _ in range(rounds)
    ]


def measure_probes(
    url: str, groups: list[list[RequestSpec]], seed: int = 7_777, warm_up: bool = True
) -> list[list[RequestRecord]]:
    """Send each group (at its requests' arrival offsets: 0 = at once), one group after
    another, to the server at `url` (the API base, e.g. http://127.0.0.1:8000/v1) with bench's
    client and exact-length prompts; returns the records of every group, but the first when
    `warm_up`. `seed` picks the prompts' words (no prefix hits)."""
    from pdserve.bench.client import Endpoint
    from pdserve.bench.prompts import load_prompt_builder
    from pdserve.bench.runner import LoadConfig, run_load

    prompts = load_prompt_builder("bundled", seed)
    measured = []
    for group in groups:
        load = LoadConfig(num_requests=len(group), seed=seed)  # open loop, all at once
        run = run_load(Endpoint(url), lambda *_, g=group: g, prompts, load, _NO_SLO,
                       "serving overhead", progress=False)  # fmt: skip
        bad = [r for r in run.records if r.status != "ok"]
        if bad:
            raise RuntimeError(f"serving-overhead probe failed: {bad[0].status}: {bad[0].error}")
        measured.append(run.records)
    return measured[1:] if warm_up else measured


def fit_overhead(cluster, dep, groups: list[list[RequestRecord]]) -> OverheadFit:
    """Fit `ServingOverhead` for `dep.mode` from `groups` of requests served together on an
    idle server (each with >= 2 output tokens; at least one lone request), against the
    simulation of each group alone on `cluster`."""
    records = [r for g in groups for r in g]
    if not any(len(g) == 1 for g in groups) or any(
        r.ttft_s is None or r.output_tokens < 2 for r in records
    ):
        raise ValueError(
            "the overhead fit needs finished requests with >= 2 output tokens, some sent alone"
        )
    import numpy as np

    from pdserve.sim.profile import nonneg_lstsq

    medians = _tpot_excess(cluster, dep, groups)
    rows = np.array(list(medians.values()))  # (TPOT excess, its slope in step_s, in seq_s)
    (step, seq), _ = nonneg_lstsq(rows[:, 1:], rows[:, 0])
    raw_request = request_excess(cluster, dep, groups, step, seq)
    fitted = ServingOverhead(max(raw_request, 0.0), step, seq)
    raw_tpot = {k: m[0] for k, m in sorted(medians.items())}
    return OverheadFit(fitted, raw_request, raw_tpot, len(records))


def request_excess(cluster, dep, groups, step_s: float, seq_s: float) -> float:
    """Median of measured - predicted TTFT over the lone requests of `groups`, with `step_s`
    and `seq_s` in the prediction: what the serving path adds once per request (raw: < 0 when
    the server was faster than predicted)."""
    lone = [g for g in groups if len(g) == 1]
    pred = _predicted(_with(cluster, dep.mode, ServingOverhead(0.0, step_s, seq_s)), dep, lone)
    return statistics.median(g[0].ttft_s - pred[g[0].index].ttft_s for g in lone)


def _tpot_excess(cluster, dep, groups) -> dict[int, tuple[float, ...]]:
    """Per group size, medians of (measured - predicted TPOT, its slope in step_s, its slope
    in seq_s). TPOT is linear in both for a given schedule; the slopes per request (the share
    of its decode a step is, and the batch it decoded in) come from simulating 1 ms of each,
    so that staggered groups (the first to arrive prefills alone; disaggregated, short prompts
    prefill on D in chunks) are weighed by the batches they actually ran in."""
    runs = [
        _predicted(_with(cluster, dep.mode, ServingOverhead(0.0, *unit)), dep, groups)
        for unit in ((0.0, 0.0), (_UNIT_S, 0.0), (0.0, _UNIT_S))
    ]
    rows: dict[int, list[tuple[float, float, float]]] = {}
    for g in groups:
        for r in g:
            bare, step, seq = (run[r.index].tpot_s for run in runs)
            slopes = ((step - bare) / _UNIT_S, (seq - bare) / _UNIT_S)
            rows.setdefault(len(g), []).append((r.tpot_s - bare, *slopes))
    return {k: tuple(map(statistics.median, zip(*v, strict=True))) for k, v in rows.items()}


_UNIT_S = 1e-3


def describe_overhead(fit: OverheadFit) -> str:
    """One line for people: the fitted overhead and, when clipped, why."""
    o = fit.overhead
    raw = ", ".join(f"{k}: {v * 1e3:+.1f}" for k, v in fit.raw_tpot_s.items())
    text = (
        f"{o.request_s * 1e3:.1f} ms per request, {o.step_s * 1e3:.2f} ms per step + "
        f"{o.seq_s * 1e3:.2f} ms per sequence ({fit.probes} requests; TPOT excess by group size "
        f"{raw} ms)"
    )
    if fit.raw_request_s < 0 or min(fit.raw_tpot_s.values()) < 0:
        text += "; served faster than the profile predicts in places (taken as 0): the "
        text += "profile may be slow, re-run it on a quiet machine"
    return text


def _with(cluster, mode: str, overhead: ServingOverhead):
    return replace(cluster, serving={**cluster.serving, mode: overhead})


def _predicted(cluster, dep, groups) -> dict[int, RequestRecord]:
    """Simulated records, by index, of each group arriving together at an idle deployment."""
    out = {}
    for g in groups:
        specs = [RequestSpec(r.index, 0.0, r.klass, r.prompt_tokens, r.output_tokens) for r in g]
        out.update((r.index, r) for r in simulate(cluster, dep, specs, _NO_SLO).records)
    return out


_NO_SLO = SLO(600.0, 60.0)  # probes are judged by their timings, not an SLO
