"""A disaggregated deployment whose pools change size while it serves: the simulated autoscaler.

`simulate_scaled` runs `simulate`'s event loop (the same instances, the same routing) and every
`interval_s` of simulated time hands a controller an `Observation` of the last interval, then
applies the (prefill, decode) counts it returns. An instance moves through

    starting (model load and warm-up, `startup_s`) -> live (routable)
        -> draining (out of the routing lists, finishing what it holds) -> gone

A pool that grows starts new instances; one that shrinks first cancels instances still
starting (newest first), then drains the live ones with the least work (the router's last
choices). An instance costs device-seconds from its start until it is gone (x its devices):
what a cluster manager bills; the initial instances start at 0, live ones end with the run.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from pdserve.bench.metrics import SLO, stats
from pdserve.bench.workload import RequestSpec
from pdserve.sim.autoscale import Autoscaler, Decision, Observation
from pdserve.sim.deployment import Cluster, Deployment
from pdserve.sim.instance import Instance, SimRequest
from pdserve.sim.simulator import (
    Loop,
    SimResult,
    Timer,
    outcome,
    servable,
    sim_requests,
    token_budget,
)

POOLS = ("prefill", "decode")
# Observation, simulated seconds -> the (prefill, decode) instances wanted, starting included.
Controller = Callable[[Observation, float], tuple[int, int]]


class Phase(enum.Enum):
    STARTING = "starting"
    LIVE = "live"
    DRAINING = "draining"
    GONE = "gone"


@dataclass
class Lease:
    """One instance's life in a pool (times in simulated seconds)."""

    inst: Instance
    pool: str
    number: int  # order of creation, across pools
    started: float
    phase: Phase = Phase.STARTING
    ended: float | None = None

    @property
    def device_s(self) -> float:
        return (self.ended - self.started) * self.inst.lat.devices


class Sample(NamedTuple):
    """One controller interval: the counts after its decision and the arrivals before it."""

    time_s: float
    prefill: int  # instances live or starting
    decode: int
    rate: float  # arrivals/s over the interval


class ScaledResult(NamedTuple):
    result: SimResult  # utilization: busy share of each pool's instance-seconds
    device_s: float  # device-seconds of every instance, starting and draining included
    series: list[Sample]
    leases: list[Lease]  # every instance ever started, in order of creation


def simulate_scaled(
    cluster: Cluster, dep: Deployment, requests: list[RequestSpec], slo: SLO,
    controller: Controller | None = None, interval_s: float = 60.0, startup_s: float = 60.0,
) -> ScaledResult:  # fmt: skip
    """Simulate disaggregated `dep` (its counts at time 0, live at once) serving `requests`
    while `controller` resizes its pools every `interval_s` (None: it stays as it is, the
    records equal `simulate`'s). Added instances take `startup_s` to become routable."""
    if dep.mode != "disagg":
        raise ValueError(f"only a disaggregated deployment's pools are resized, got {dep.mode}")
    if not interval_s > 0 or startup_s < 0:
        raise ValueError(f"need interval_s > 0 and startup_s >= 0, got {interval_s}, {startup_s}")
    sims = sim_requests(requests)
    budget = token_budget(dep, requests)
    loop = _ScalingLoop(cluster, dep, budget, slo, sims, controller, interval_s, startup_s)
    ready = servable(loop, sims)
    loop.next_tick(0.0)
    loop.run(ready, None)
    records, aggregates = outcome(loop, sims, ready)
    end = max(aggregates["duration_s"], loop.last_arrival)
    for lease in loop.leases:
        if lease.ended is None:
            lease.ended = end
    util = {pool: _busy([x for x in loop.leases if x.pool == pool]) for pool in POOLS}
    result = SimResult(records, aggregates, util, loop.fabric.bytes_sent)
    return ScaledResult(result, sum(x.device_s for x in loop.leases), loop.series, loop.leases)


def controlled_by(scaler: Autoscaler, decisions: list[Decision] | None = None) -> Controller:
    """A controller that asks `scaler`, keeping each `Decision` in `decisions` if given."""

    def control(obs: Observation, now: float) -> tuple[int, int]:
        decision = scaler.decide(obs, now)
        if decisions is not None:
            decisions.append(decision)
        return decision.prefill, decision.decode

    return control


class _ScalingLoop(Loop):
    """The event loop plus the pools' leases, the controller's ticks and the observations."""

    def __init__(
        self, cluster: Cluster, dep: Deployment, budget: int, slo: SLO, sims: list[SimRequest],
        controller: Controller | None, interval_s: float, startup_s: float,
    ) -> None:  # fmt: skip
        super().__init__(cluster, dep, budget, slo)
        self.controller, self.interval_s, self.startup_s = controller, interval_s, startup_s
        self.routable = {"prefill": self.front, "decode": self.decoders}  # changed in place
        initial = [(pool, inst) for pool in POOLS for inst in self.routable[pool]]
        self.leases = [Lease(inst, pool, n, 0.0, Phase.LIVE)
                       for n, (pool, inst) in enumerate(initial)]  # fmt: skip
        self.made = {pool: len(self.routable[pool]) for pool in POOLS}  # for instance names
        self.draining: list[Lease] = []
        self.series: list[Sample] = []
        self.sims, self.next_arrival, self.next_finish = sims, 0, 0
        self.last_arrival = sims[-1].arrival if sims else 0.0  # no decisions after it
        self.awaiting: list[SimRequest] = []  # arrived, no first token yet

    # -- hooks on the base loop's events -----------------------------------------------------
    def arrive(self, r: SimRequest, now: float) -> None:
        super().arrive(r, now)
        self.awaiting.append(r)

    def instance_done(self, inst: Instance, now: float) -> None:
        super().instance_done(inst, now)
        if self.draining:
            self.reap(now)

    def fabric_done(self, now: float) -> None:
        super().fabric_done(now)
        if self.draining:
            self.reap(now)

    # -- the controller's interval ----------------------------------------------------------
    def next_tick(self, now: float) -> None:
        if now + self.interval_s <= self.last_arrival:
            self.push(now + self.interval_s, 0, Timer(self.tick))

    def tick(self, now: float) -> None:
        obs = self.observe(now)
        want = (obs.prefill, obs.decode)
        if self.controller is not None:
            want = self.controller(obs, now)
        if min(want) < 1:
            raise ValueError(
                f"the controller asked for {want[0]}P+{want[1]}D at {now:.0f} s; the simulated "
                "deployment needs at least one instance in each pool (ScaleBounds.min_prefill)"
            )
        for pool, n in zip(POOLS, want, strict=True):
            self.resize(pool, n, now)
        self.series.append(Sample(now, *self.counts(), obs.rate))
        self.next_tick(now)

    def observe(self, now: float) -> Observation:
        """The last interval as the live autoscaler sees it: what arrived (by send time), the
        TTFT of first tokens and the TPOT of finishes in it, prompt tokens queued now."""
        start = self.next_arrival
        while self.next_arrival < len(self.sims) and self.sims[self.next_arrival].arrival <= now:
            self.next_arrival += 1
        lengths = [(r.prompt, r.output) for r in self.sims[start : self.next_arrival]]
        ttfts = [r.first_token - r.arrival for r in self.awaiting if r.first_token is not None]
        self.awaiting = [r for r in self.awaiting if r.first_token is None]
        done = self.finished[self.next_finish :]
        self.next_finish = len(self.finished)
        tpots = [(r.finish - r.first_token) / (r.output - 1) for r in done if r.output > 1]
        queued = sum(x.inst.queued_tokens for x in self.leases if x.phase is not Phase.GONE)
        starting = [sum(x.pool == p and x.phase is Phase.STARTING for x in self.leases)
                    for p in POOLS]  # fmt: skip
        p90s = stats(ttfts)["p90"], stats(tpots)["p90"]
        return Observation(self.interval_s, lengths, *self.counts(), *p90s,
                           queued, *starting)  # fmt: skip

    def counts(self) -> tuple[int, int]:
        """Instances live or starting per pool."""
        up = (Phase.STARTING, Phase.LIVE)
        return tuple(sum(x.pool == p and x.phase in up for x in self.leases) for p in POOLS)

    # -- growing and shrinking --------------------------------------------------------------
    def resize(self, pool: str, want: int, now: float) -> None:
        up = [x for x in self.leases if x.pool == pool and x.phase in (Phase.STARTING, Phase.LIVE)]
        for _ in range(want - len(up)):
            self.launch(pool, now)
        # Starting ones first (newest first), then the live ones with the least work.
        order = sorted(up, key=lambda x: (x.phase is Phase.LIVE, _work(x.inst), -x.number))
        for lease in order[: max(0, len(up) - want)]:
            self.retire(lease, now)

    def launch(self, pool: str, now: float) -> None:
        inst = self.new_instance(pool, self.made[pool])
        self.made[pool] += 1
        lease = Lease(inst, pool, len(self.leases), now)
        self.leases.append(lease)
        self.push(now + self.startup_s, 0, Timer(partial(self.go_live, lease)))

    def go_live(self, lease: Lease, now: float) -> None:
        if lease.phase is Phase.STARTING:  # not cancelled while it started
            lease.phase = Phase.LIVE
            self.routable[lease.pool].append(lease.inst)

    def retire(self, lease: Lease, now: float) -> None:
        if lease.phase is Phase.STARTING:
            lease.phase, lease.ended = Phase.GONE, now
            return
        lease.phase = Phase.DRAINING
        self.routable[lease.pool].remove(lease.inst)
        self.draining.append(lease)
        self.reap(now)

    def reap(self, now: float) -> None:
        """Draining instances that hold nothing any more are gone now."""
        for lease in [x for x in self.draining if _idle(x.inst)]:
            lease.phase, lease.ended = Phase.GONE, now
            self.draining.remove(lease)


def _work(inst: Instance) -> tuple[int, int]:
    """Prompt tokens queued, then requests held or on their way (the router's load)."""
    return inst.queued_tokens, inst.load + inst.inbound


def _idle(inst: Instance) -> bool:
    """Nothing computing, queued, on its way in, or KV still to send."""
    return inst.busy_until is None and not inst.load and not inst.inbound and not inst.kv_used


def _busy(leases: list[Lease]) -> float:
    alive = sum(x.ended - x.started for x in leases)
    return sum(x.inst.busy_time for x in leases) / alive if alive > 0 else 0.0
