"""`pdserve plan`: search deployments for the fewest GPUs that serve a rate within the SLOs.

DistServe's placement search, extended to chunked prefill and to bandwidth-limited KV links:

1. For each instance shape (co-located TP x chunk size; prefill TP; decode TP) find by
   simulation the highest rate one instance sustains at >= 90 % attainment (its capacity).
   Disaggregated pools are measured apart: prefill instances against the TTFT target (KV
   transfer included) with decoding unconstrained, decode instances against the TPOT target
   with prefill unconstrained.
2. Size each candidate for the target rate (replicas = rate / capacity, rounded up), then
   simulate the whole deployment at that rate and add instances to the pool that misses most
   until it meets the target or exceeds the GPU budget.
3. Rank: fewest GPUs, then highest goodput per GPU. Nothing is decided by rule; which mode
   wins is whatever the simulation says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from pdserve.bench.metrics import GOODPUT_ATTAINMENT, SLO
from pdserve.bench.workload import Workload, generate_requests
from pdserve.sim.deployment import Cluster, Deployment
from pdserve.sim.simulator import SimResult, simulate

TP_CHOICES = (1, 2, 4, 8)
CHUNK_CHOICES = (None, 256, 512, 1024, 2048)
_LOOSE = 1e9  # an SLO target that never binds


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for. `num_requests` sizes each simulation (more is slower, less noisy)."""

    cluster: Cluster
    workload: Workload
    rate: float
    slo: SLO
    max_gpus: int | None = None
    num_requests: int = 300
    seed: int = 0
    target: float = GOODPUT_ATTAINMENT

    def __post_init__(self) -> None:
        if not self.rate > 0 or math.isinf(self.rate):
            raise ValueError(f"--rate must be a finite number of requests/s > 0, got {self.rate}")
        if self.max_gpus is not None and self.max_gpus < 1:
            raise ValueError(f"--num-gpus must be >= 1, got {self.max_gpus}")
        if self.num_requests < 20:
            raise ValueError(f"need >= 20 simulated requests per run, got {self.num_requests}")


class Candidate(NamedTuple):
    """A sized deployment and its simulation at the target rate."""

    deployment: Deployment
    result: SimResult
    goodput: float  # estimated req/s the deployment sustains at >= 90 % attainment

    @property
    def attainment(self) -> float:
        return _attainment(self.result)

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.deployment.num_gpus


class Plan(NamedTuple):
    """Feasible candidates best first, and the best of the infeasible (if none is feasible)."""

    feasible: list[Candidate]
    closest: Candidate | None


class _Search:
    def __init__(self, req: PlanRequest) -> None:
        self.req = req
        self.cache: dict[tuple, SimResult] = {}

    def run(
        self, dep: Deployment, rate: float, slo: SLO, n: int | None = None, early: bool = False
    ) -> SimResult:
        """Simulate `dep` at `rate`; `early` stops as soon as the target is out of reach."""
        key = (dep, rate, slo, n, early)
        if key not in self.cache:
            count = n or self.req.num_requests
            reqs = generate_requests(self.req.workload, count, self.req.seed, rate=rate)
            stop = int(count * (1 - self.req.target)) if early else None
            self.cache[key] = simulate(self.req.cluster, dep, reqs, slo, stop)
        return self.cache[key]

    def attains(self, dep: Deployment, rate: float, slo: SLO) -> bool:
        got = self.run(dep, rate, slo, early=True).aggregates["slo_attainment"]
        return got is not None and got >= self.req.target

    def capacity(self, dep: Deployment, slo: SLO) -> float:
        """Highest rate (to ~8 %) at which one `dep` attains the target; 0 if none in range.

        Starts at the target rate and steps up (x4) or down (/2) to bracket the capacity, so
        a low-traffic plan does not spend simulations far below its rate, then bisects.
        """
        rate = self.req.rate
        floor = rate * dep.num_gpus / _gpu_cap(self.req)  # below this, too many GPUs anyway
        if self.attains(dep, rate, slo):
            lo, hi = rate, rate * 4
            while self.attains(dep, hi, slo):
                lo, hi = hi, hi * 4
                if hi > rate * 1024:
                    return lo
        else:
            lo, hi = rate / 2, rate
            while not self.attains(dep, lo, slo):
                lo, hi = lo / 2, lo
                if lo < floor:
                    return 0.0
        while hi / lo > 1.08:
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if self.attains(dep, mid, slo) else (lo, mid)
        return lo


def _valid_tps(cluster: Cluster, workload: Workload) -> list[int]:
    """TP degrees whose weights fit with room for at least one long request's KV."""
    need = max(c.prompt.expected + c.output.expected for c in workload.classes)
    return [
        tp
        for tp in TP_CHOICES
        if tp <= cluster.accel.max_tp
        and cluster.model.num_heads % tp == 0
        and cluster.latency(tp).kv_capacity_tokens >= 2 * need
    ]


def plan(req: PlanRequest) -> Plan:
    """Search every mode x TP x chunk (co-located) and prefill TP x decode TP (disaggregated)."""
    search = _Search(req)
    tps = _valid_tps(req.cluster, req.workload)
    if not tps:
        raise ValueError(
            f"{req.cluster.model.name} does not fit on up to {max(TP_CHOICES)} x "
            f"{req.cluster.accel.name} with room for its KV cache; choose a larger GPU"
        )
    candidates = [c for c in _colocated(search, tps) + _disaggregated(search, tps) if c]
    ok = [c for c in candidates if c.attainment >= req.target and _within_budget(req, c)]
    ok.sort(key=lambda c: (c.deployment.num_gpus, -c.goodput_per_gpu))
    closest = None
    if not ok and candidates:
        best = max(candidates, key=lambda c: (c.attainment, -_overshoot(c, req.slo)))
        full = search.run(best.deployment, req.rate, req.slo, 2 * req.num_requests)
        closest = best._replace(result=full)  # searched runs stop early; report a whole one
    return Plan(ok, closest)


def _overshoot(c: Candidate, slo: SLO) -> float:
    """How far the worse p90 is past its target (1.0 = on target); for ranking misses."""
    a = c.result.aggregates
    ttft, tpot = a["ttft_s"]["p90"], a["tpot_s"]["p90"]
    return max((ttft or math.inf) / slo.ttft_s, (tpot or 0.0) / slo.tpot_s)


def _within_budget(req: PlanRequest, c: Candidate) -> bool:
    return req.max_gpus is None or c.deployment.num_gpus <= req.max_gpus


def _gpu_cap(req: PlanRequest) -> int:
    return req.max_gpus or 512


def _colocated(search: _Search, tps: list[int]) -> list[Candidate | None]:
    out = []
    for tp in tps:
        for chunk in CHUNK_CHOICES:
            one = Deployment("colocated", tp=tp, chunk=chunk)
            cap = search.capacity(one, search.req.slo)
            if cap == 0:
                out.append(_unmet(search, one))
                continue
            replicas = math.ceil(search.req.rate / cap)
            out.append(_grow(search, replace(one, replicas=replicas), cap * replicas))
    return out


def _disaggregated(search: _Search, tps: list[int]) -> list[Candidate | None]:
    slo = search.req.slo
    # Each pool is measured with the other made ample. Prefill against TTFT alone; decode
    # against both targets, since KV arriving over its ports delays first tokens too.
    p_caps = {
        tp: search.capacity(
            Deployment("disagg", prefill_tp=tp, decode_tp=max(tps), num_decode=4),
            SLO(slo.ttft_s, _LOOSE),
        )  # fmt: skip
        for tp in tps
    }
    d_caps = {
        tp: search.capacity(
            Deployment("disagg", prefill_tp=max(tps), num_prefill=8, decode_tp=tp), slo
        )
        for tp in tps
    }
    out = []
    for ptp in tps:
        for dtp in tps:
            base = Deployment("disagg", prefill_tp=ptp, decode_tp=dtp)
            if not p_caps[ptp] or not d_caps[dtp]:
                out.append(_unmet(search, base))
                continue
            n_p = math.ceil(search.req.rate / p_caps[ptp])
            n_d = math.ceil(search.req.rate / d_caps[dtp])
            goodput = min(n_p * p_caps[ptp], n_d * d_caps[dtp])
            out.append(_grow(search, replace(base, num_prefill=n_p, num_decode=n_d), goodput))
    return out


def _unmet(search: _Search, dep: Deployment) -> Candidate:
    """A shape that misses the SLOs even when idle: report it at the target rate as is."""
    return Candidate(dep, search.run(dep, search.req.rate, search.req.slo, early=True), 0.0)


def _grow(search: _Search, dep: Deployment, goodput: float, tries: int = 4) -> Candidate | None:
    """Simulate `dep` at the target rate; while it misses, add the instance that helps most."""
    req, n = search.req, 2 * search.req.num_requests
    for _ in range(tries):
        if dep.num_gpus > _gpu_cap(req):
            return None
        result = search.run(dep, req.rate, req.slo, n, early=True)
        if (result.aggregates["slo_attainment"] or 0.0) >= req.target:  # ran to the end
            return Candidate(dep, result, max(goodput, req.rate))
        options = [replace(dep, replicas=dep.replicas + 1)]
        if dep.mode == "disagg":
            options = [replace(dep, num_prefill=dep.num_prefill + 1),
                       replace(dep, num_decode=dep.num_decode + 1)]  # fmt: skip
        dep = max(options, key=lambda d: _attainment(search.run(d, req.rate, req.slo, n, True)))
    return Candidate(dep, search.run(dep, req.rate, req.slo, n, early=True), goodput)


def _attainment(result: SimResult) -> float:
    return result.aggregates["slo_attainment"] or 0.0
