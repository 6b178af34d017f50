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
3. Rank by the objective: fewest GPUs (then highest goodput per GPU), lowest $ per hour (then
   highest goodput per dollar) or lowest watts (then goodput per watt). Nothing is decided by
   rule; which mode wins is whatever the simulation says.

Heterogeneous pools (Splitwise): with several device types (`prefill_gpus`, `decode_gpus`,
names of `Cluster.devices`) every type is searched on its own (co-located and disaggregated,
homogeneous) and every prefill type with every decode type; a pool's capacity is measured on
its own hardware, and the KV transfer between two types runs at the slower end's link. For
mixture-of-experts models each pool's shapes include expert parallelism (EP 2..8 over
data-parallel attention, `LatencyModel`), so a plan may recommend `--decode-ep`. The prefill
pool's shapes include pipelines (`--prefill-pp` 2, 4 stages of the widest shape, within the GPU
budget) whose micro-batch is a prefill chunk (`micro_batch`): a pipeline spans nodes, where a
prompt too long for one node's TTFT can still be prefilled in time.

Over 300 lines on purpose: the three steps above are one search over one `_Search` (its cache of
measured capacities), read top to bottom; what `pdserve plan` prints is `sim/report.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from pdserve.bench.metrics import GOODPUT_ATTAINMENT, SLO
from pdserve.bench.workload import Workload, generate_requests
from pdserve.sim.deployment import Cluster, Deployment
from pdserve.sim.shapes import Shape, pipelines, valid_shapes, widest
from pdserve.sim.simulator import SimResult, simulate

CHUNK_CHOICES = (None, 256, 512, 1024, 2048)
OBJECTIVES = ("gpus", "cost", "power")
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
    objective: str = "gpus"
    # Device names (`Cluster.devices`; None: the cluster's own accelerator) each pool may use.
    prefill_gpus: tuple[str | None, ...] = (None,)
    decode_gpus: tuple[str | None, ...] = (None,)

    @property
    def kinds(self) -> list[str | None]:
        """Every device type searched, in the order given."""
        return list(dict.fromkeys((*self.prefill_gpus, *self.decode_gpus)))

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--optimize must be one of {', '.join(OBJECTIVES)}, "
                             f"got {self.objective!r}")  # fmt: skip
        if not self.prefill_gpus or not self.decode_gpus:
            raise ValueError("give at least one device for each pool")
        for gpu in self.kinds:
            accel = self.cluster.device(gpu).accel
            for objective, figure, flag in (("cost", accel.cost_per_hour, "--gpu-cost"),
                                            ("power", accel.power_w, "--gpu-power")):  # fmt: skip
                if self.objective == objective and not figure > 0:
                    raise ValueError(f"--optimize {objective} needs a figure for {accel.name}: "
                                     f"give {flag} {accel.name}=NUMBER")  # fmt: skip
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


def mean_lengths(workload: Workload) -> tuple[int, int]:
    """Mean prompt and output tokens of `workload`'s mix."""
    pairs = zip(workload.probabilities, workload.classes, strict=True)
    prompt = output = 0.0
    for prob, c in pairs:
        prompt, output = prompt + prob * c.prompt.expected, output + prob * c.output.expected
    return round(prompt), round(output)


def spend(c: Candidate, cluster: Cluster, objective: str) -> float:
    """What `objective` minimises for `c`: GPUs, $ per hour or watts."""
    if objective == "cost":
        return c.deployment.cost_per_hour(cluster)
    if objective == "power":
        return c.deployment.power_w(cluster)
    return float(c.deployment.num_gpus)


def rank_key(c: Candidate, cluster: Cluster, objective: str) -> tuple[float, float]:
    """Least spend first, then most goodput per unit spent."""
    cost = spend(c, cluster, objective)
    return cost, -c.goodput / cost if cost else 0.0


def cost_per_million_tokens(c: Candidate, req: PlanRequest) -> float:
    """$ per million tokens (prompt + output) served at the deployment's goodput."""
    tokens_s = c.goodput * sum(mean_lengths(req.workload))
    return c.deployment.cost_per_hour(req.cluster) / (tokens_s * 3600) * 1e6 if tokens_s else 0.0


def goodput_per_dollar(c: Candidate, req: PlanRequest) -> float:
    """Requests served within the SLOs per dollar."""
    dollars = c.deployment.cost_per_hour(req.cluster)
    return c.goodput * 3600 / dollars if dollars else 0.0


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


def _pipelines(req: PlanRequest, shapes: list[Shape]) -> list[Shape]:
    """The prefill pipelines searched for `req` (`pipelines`, within its GPU budget)."""
    prompt = mean_lengths(req.workload)[0]
    return pipelines(req.cluster.model, shapes, prompt, _gpu_cap(req))


def plan(req: PlanRequest) -> Plan:
    """Search every device type x mode x shape x chunk (co-located) and every prefill device
    and shape x decode device and shape (disaggregated); rank by `req.objective`."""
    search = _Search(req)
    shapes = {gpu: valid_shapes(req.cluster, req.workload, gpu) for gpu in req.kinds}
    for gpu, found in shapes.items():
        if not found:
            accel = req.cluster.device(gpu).accel
            raise ValueError(
                f"{req.cluster.model.name} does not fit on up to {accel.max_tp} x "
                f"{accel.name} with room for its KV cache; choose a larger GPU"
            )
    pairs = [(p, d) for p in req.prefill_gpus for d in req.decode_gpus]
    pairs = list(dict.fromkeys([*((g, g) for g in req.kinds), *pairs]))
    candidates = [c for gpu in req.kinds for c in _colocated(search, gpu, shapes[gpu]) if c]
    prefill = {gpu: [*found, *_pipelines(req, found)] for gpu, found in shapes.items()}
    candidates += [c for c in _disaggregated(search, prefill, shapes, pairs) if c]
    ok = [c for c in candidates if c.attainment >= req.target and _within_budget(req, c)]
    ok.sort(key=lambda c: rank_key(c, req.cluster, req.objective))
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


def _colocated(search: _Search, gpu: str | None, shapes: list[Shape]) -> list[Candidate | None]:
    out = []
    for tp in sorted({s.tp for s in shapes if s.ep == 1}):
        for chunk in CHUNK_CHOICES:
            one = Deployment("colocated", tp=tp, chunk=chunk, gpu=gpu)
            cap = search.capacity(one, search.req.slo)
            if cap == 0:
                out.append(_unmet(search, one))
                continue
            replicas = math.ceil(search.req.rate / cap)
            out.append(_grow(search, replace(one, replicas=replicas), cap * replicas))
    return out


def _prefill(gpu: str | None, shape: Shape, n: int = 1) -> dict:
    return {"prefill_gpu": gpu, "prefill_tp": shape.tp, "prefill_ep": shape.ep,
            "prefill_pp": shape.pp, "chunk": shape.chunk, "num_prefill": n}  # fmt: skip


def _decode(gpu: str | None, shape: Shape, n: int = 1) -> dict:
    return {"decode_gpu": gpu, "decode_tp": shape.tp, "decode_ep": shape.ep, "num_decode": n}


def _disaggregated(
    search: _Search, prefill: dict[str | None, list[Shape]],
    one_node: dict[str | None, list[Shape]], pairs: list[tuple],
) -> list[Candidate | None]:  # fmt: skip
    """Every prefill shape (pipelines included) with every one-node decode shape of each
    device pair."""
    slo = search.req.slo

    # Each pool is measured on its own hardware with the other made ample on the other
    # pool's hardware in that pair (the widest one-node shape). Prefill against TTFT alone;
    # decode against both targets, since KV arriving over its ports delays first tokens too.
    p_caps, d_caps = {}, {}
    for pg, dg in pairs:
        for shape in prefill[pg]:
            ample = _decode(dg, widest(one_node[dg]), 4)
            dep = Deployment("disagg", **_prefill(pg, shape), **ample)
            p_caps[pg, dg, shape] = search.capacity(dep, SLO(slo.ttft_s, _LOOSE))
        for shape in one_node[dg]:
            ample = _prefill(pg, _ample_prefill(search.req, pg, one_node[pg], prefill[pg]), 8)
            dep = Deployment("disagg", **ample, **_decode(dg, shape))
            d_caps[pg, dg, shape] = search.capacity(dep, slo)
    out = []
    for pg, dg in pairs:
        for ps in prefill[pg]:
            for ds in one_node[dg]:
                base = Deployment("disagg", **_prefill(pg, ps), **_decode(dg, ds))
                p_cap, d_cap = p_caps[pg, dg, ps], d_caps[pg, dg, ds]
                if not p_cap or not d_cap:
                    out.append(_unmet(search, base))
                    continue
                n_p = math.ceil(search.req.rate / p_cap)
                n_d = math.ceil(search.req.rate / d_cap)
                goodput = min(n_p * p_cap, n_d * d_cap)
                dep = replace(base, num_prefill=n_p, num_decode=n_d)
                out.append(_grow(search, dep, goodput))
    return out


def _ample_prefill(
    req: PlanRequest, gpu: str | None, one_node: list[Shape], shapes: list[Shape]
) -> Shape:
    """The prefill shape that makes a prefill pool ample while decode is measured: the widest
    one-node shape, or, when that cannot prefill the mean prompt within the TTFT target (only
    a pipeline can), the fastest of `shapes`."""
    prompt = mean_lengths(req.workload)[0]

    def prefill_s(s: Shape) -> float:
        return req.cluster.latency(s.tp, gpu=gpu, ep=s.ep, pp=s.pp).prefill(prompt, chunk=s.chunk)

    wide = widest(one_node)
    return wide if prefill_s(wide) <= req.slo.ttft_s else min(shapes, key=prefill_s)


def _unmet(search: _Search, dep: Deployment) -> Candidate:
    """A shape whose capacity search found no rate within the SLOs: report it at the target
    rate as is (its goodput is that rate should it attain there after all)."""
    req = search.req
    result = search.run(dep, req.rate, req.slo, early=True)
    return Candidate(dep, result, req.rate if _attainment(result) >= req.target else 0.0)


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
