"""Percentile statistics over weighted samples (value v seen w times), matching bench's `stats`.

The simulator records inter-token latencies as (gap, count) pairs, because a decode stretch of
k steps over B sequences yields k x B gaps of nearly one value; expanding them would cost
memory and time on 100,000-request runs. Percentiles interpolate linearly between order
statistics exactly as `numpy.percentile` does on the expanded list.
"""

from __future__ import annotations

from collections.abc import Sequence


def weighted_stats(values: Sequence[float], weights: Sequence[float]) -> dict:
    """count, mean, p50, p90, p99, max of the multiset where values[i] occurs weights[i] times."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.int64)
    keep = w > 0
    v, w = v[keep], w[keep]
    total = int(w.sum())
    if total == 0:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    order = np.argsort(v, kind="stable")
    v, cum = v[order], np.cumsum(w[order])

    def at(rank: np.ndarray) -> np.ndarray:  # the rank-th smallest (0-based) of the multiset
        return v[np.searchsorted(cum, rank, side="right")]

    h = np.array([0.5, 0.9, 0.99]) * (total - 1)
    lo = np.floor(h)
    pct = at(lo) + (h - lo) * (at(np.minimum(lo + 1, total - 1)) - at(lo))
    return {
        "count": total,
        "mean": float((v * w[order]).sum() / total),
        "p50": float(pct[0]),
        "p90": float(pct[1]),
        "p99": float(pct[2]),
        "max": float(v[-1]),
    }
