"""Admission control: pure checks over a `ClusterView` that raise `Overloaded` (429 with
Retry-After) for a request the cluster cannot take now. A request is never refused for its own
size alone (retrying would not help): with nothing queued ahead of it, it is admitted."""

from __future__ import annotations

import math

from pdserve.router.config import RouterConfig
from pdserve.router.placement import ClusterView
from pdserve.router.state import WorkerInfo

# Admission compares moving averages and estimates with the SLOs, and a request admitted now
# decodes beside the streams admitted after it, before the next heartbeat shows them: admit
# only with room to spare. Measured at 3x overload (benchmarks/admission.py, chat, 1 P + 1 D):
# with no headroom admitted p99s reached 2.5 s against a 2 s TTFT target and 200-250 ms against
# 200 ms TPOT; at 0.8 for both, TTFT p99 was 1.9 s and TPOT p99 201 ms (requests admitted while
# the decode batch was ramping up), hence more room for TPOT.
TTFT_HEADROOM = 0.8
TPOT_HEADROOM = 0.75


class Overloaded(Exception):
    """Admission control refused a request (the client should retry later: 429).
    `reason` labels the metric; `retry_after_s` is when admitting it is likely to work."""

    def __init__(self, message: str, reason: str = "max_inflight", retry_after_s: int = 1):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


def check_capacity(config: RouterConfig, inflight: int) -> None:
    if inflight >= config.max_inflight:
        raise Overloaded(f"{inflight} requests are in flight (--max-inflight)")


def check_slo(
    config: RouterConfig, view: ClusterView, decode: WorkerInfo, remote: bool, uncached: int
) -> None:
    """Raise Overloaded when admitting this request would miss the SLOs because of the work
    already admitted.

    TTFT estimate = (prompt tokens waiting for prefill where this one will be prefilled
    + this one's uncached tokens) / that pool's measured prefill tokens/s. TPOT = the decode
    worker's measured seconds per step while it decodes.

    With the autoscaler (`config.autoscale_max`), the pools grow before admission refuses:
    the TTFT estimate uses the prefill speed the largest allowed pool would have (its measured
    speed per worker times the allowed count), and TPOT refuses only once the decode pool is at
    its largest. What such pools could not serve is still refused."""
    growth = _growth(config, view)
    if config.slo_ttft_s is not None:
        pool = view.prefill_pool if remote else [decode]
        rate = sum(w.load.prefill_tok_s for w in pool if w.load is not None)
        rate *= growth[0 if remote else 1]
        ahead = view.queued(remote, decode.worker_id)
        if rate > 0 and ahead > 0:
            ttft = (ahead + uncached) / rate
            limit = config.slo_ttft_s * TTFT_HEADROOM
            if ttft > limit:
                raise Overloaded(
                    f"estimated time to first token {ttft:.2f} s is too close to the "
                    f"{config.slo_ttft_s:g} s SLO ({ahead} prompt tokens queued at "
                    f"{rate:.0f} tokens/s)",
                    reason="slo_ttft",
                    retry_after_s=retry_after(ttft - limit),
                )
    at_largest = growth[1] <= 1.0
    if config.slo_tpot_s is not None and decode.inflight and decode.load is not None and at_largest:
        tpot = decode.load.decode_step_s
        if tpot > config.slo_tpot_s * TPOT_HEADROOM:
            raise Overloaded(
                f"the decode worker's time per output token is {tpot * 1000:.0f} ms, too "
                f"close to the {config.slo_tpot_s * 1000:g} ms SLO to take another stream",
                reason="slo_tpot",
                retry_after_s=2,
            )


def _growth(config: RouterConfig, view: ClusterView) -> tuple[float, float]:
    """How many times larger the prefill and decode pools may still grow (1: they cannot)."""
    if config.autoscale_max is None:
        return 1.0, 1.0
    most_p, most_d = config.autoscale_max
    p, d = len(view.prefill_pool), len(view.decoders)
    return (max(1.0, most_p / p) if p else 1.0), (max(1.0, most_d / d) if d else 1.0)


def retry_after(seconds: float) -> int:
    """Whole seconds for a Retry-After header: at least 1, at most 30."""
    return max(1, min(30, math.ceil(seconds)))
