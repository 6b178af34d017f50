"""Per-request records, SLOs, and the aggregate statistics of a benchmark run.

`RequestRecord` is one request's raw timings, as measured by the load generator or produced by
the simulator. `summarize(records, slo, duration_s)` turns a list of them into "the bench JSON
aggregates", a plain dict of this fixed shape (both `pdserve bench` and `pdserve.sim` emit it,
so keep it stable; times in seconds, None where there is nothing to measure)::

    {
      "num_requests": int,                   # every record, whatever its status
      "status": {"ok": int, "error": int, "timeout": int},
      "duration_s": float,                   # wall time of the run, as passed in
      "request_throughput": float,           # ok requests / duration_s
      "output_token_throughput": float,      # output tokens of ok requests / duration_s
      "prompt_token_throughput": float,      # prompt tokens of ok requests / duration_s
      "ttft_s": STATS, "tpot_s": STATS, "itl_s": STATS, "e2e_s": STATS,
      "slo": {"ttft_s": float, "tpot_s": float, "itl_p99_s": float | None},
      "slo_attainment": float | None,        # fraction of ALL requests meeting the SLO
    }
    STATS = {"count": int, "mean", "p50", "p90", "p99", "max": float | None}

Latency statistics are over ok requests only; ``itl_s`` pools every inter-token interval of every
ok request. Errors and timeouts count as SLO misses. `summarize_by_class` gives one such dict per
request class. Goodput (DistServe) is `goodput(attainment by rate)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np

STATUSES = ("ok", "error", "timeout")
GOODPUT_ATTAINMENT = 0.9  # DistServe: at least 90 % of requests meet the SLO


class RequestRecord(msgspec.Struct, kw_only=True):
    """One request's outcome; times are seconds, `arrival_s`/`start_s` from the run's start.

    `arrival_s` is when the request was due, `start_s` when it was sent; `ttft_s` and `e2e_s`
    count from `start_s`. `itl_s` holds every interval between consecutive chunks that carried
    output. `tpot_s` = (e2e - ttft) / (output_tokens - 1), None with fewer than 2 tokens.
    A failed request keeps whatever was measured before it failed and says why in `error`.
    """

    index: int
    klass: str
    status: Literal["ok", "error", "timeout"]
    error: str | None = None
    arrival_s: float
    start_s: float
    ttft_s: float | None = None
    itl_s: list[float] = msgspec.field(default_factory=list)
    tpot_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def tpot(ttft_s: float | None, e2e_s: float | None, output_tokens: int) -> float | None:
    """Time per output token after the first, or None when it is undefined."""
    if ttft_s is None or e2e_s is None or output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds; a request meets the SLO when it meets every target set."""

    ttft_s: float
    tpot_s: float
    itl_p99_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "itl_p99_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO target {name} must be > 0 seconds, got {value}")

    def meets(self, record: RequestRecord) -> bool:
        """True when `record` is ok and within every target (a missing TPOT/ITL passes)."""
        if not record.ok or record.ttft_s is None or record.ttft_s > self.ttft_s:
            return False
        if record.tpot_s is not None and record.tpot_s > self.tpot_s:
            return False
        if self.itl_p99_s is not None and record.itl_s:
            return float(np.percentile(record.itl_s, 99)) <= self.itl_p99_s
        return True


def stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean, p50, p90, p99 and max of `values` (linear-interpolated percentiles)."""
    if len(values) == 0:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "count": int(arr.size),
        "mean": float(arr.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(arr.max()),
    }


def summarize(records: Sequence[RequestRecord], slo: SLO, duration_s: float) -> dict:
    """The aggregates of a run, in the shape documented at the top of this module."""
    ok = [r for r in records if r.ok]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return {
        "num_requests": len(records),
        "status": {s: sum(r.status == s for r in records) for s in STATUSES},
        "duration_s": duration_s,
        "request_throughput": len(ok) * per_s,
        "output_token_throughput": sum(r.output_tokens for r in ok) * per_s,
        "prompt_token_throughput": sum(r.prompt_tokens for r in ok) * per_s,
        "ttft_s": stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": stats([x for r in ok for x in r.itl_s]),
        "e2e_s": stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "itl_p99_s": slo.itl_p99_s},
        "slo_attainment": (sum(slo.meets(r) for r in records) / len(records) if records else None),
    }


def summarize_by_class(
    records: Iterable[RequestRecord], slo: SLO, duration_s: float
) -> dict[str, dict]:
    """`summarize` per request class, keyed by class name in order of first appearance."""
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(record.klass, []).append(record)
    return {name: summarize(group, slo, duration_s) for name, group in groups.items()}


def goodput(
    attainment_by_rate: Mapping[float, float | None], target: float = GOODPUT_ATTAINMENT
) -> float | None:
    """DistServe's goodput: the highest rate whose SLO attainment is >= `target`.

    Rates are taken in increasing order and the search stops at the first rate that misses, so
    a lucky pass above a failing rate does not count. None when even the lowest rate misses.
    """
    best = None
    for rate in sorted(attainment_by_rate):
        attained = attainment_by_rate[rate]
        if attained is None or attained < target:
            break
        best = rate
    return best
