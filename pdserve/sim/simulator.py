"""Discrete-event simulation of a deployment serving a list of requests.

Deployments: co-located continuous batching (whole prompts per step), co-located with chunked
prefill, and disaggregated P:D pools with their own TP degrees joined by the KV `Fabric`.
Arrivals are routed like pdserve's router: co-located and decode instances by fewest prompt
tokens queued for their own prefill, then least outstanding requests; prefill instances by
fewest queued prompt tokens. Events are instance iteration or
decode-stretch ends, fabric completions and remote prompts reaching the prefill pool once their
decode instance has placed them (between two of its steps), in a heap; arrivals are merged in
from their sorted list. A calibrated serving path (`Cluster.serving`) delays every arrival by
its per-request overhead and lengthens every iteration by its per-step and per-sequence ones.
The output is bench's `RequestRecord`s and `summarize` aggregates, so simulated and measured
runs share one JSON shape.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

from pdserve.bench.metrics import SLO, RequestRecord, summarize, tpot
from pdserve.bench.workload import RequestSpec
from pdserve.sim.deployment import Cluster, Deployment
from pdserve.sim.fabric import Fabric
from pdserve.sim.instance import Instance, SimRequest
from pdserve.sim.latency import steps_to_reach, stretch_time
from pdserve.sim.stats import weighted_stats


class SimResult(NamedTuple):
    records: list[RequestRecord]
    aggregates: dict  # bench's summarize() shape
    utilization: dict[str, float]  # busy fraction per pool
    kv_bytes_sent: float


class _Loop:
    """The event loop state; one per `simulate` call."""

    def __init__(self, cluster: Cluster, dep: Deployment, budget: int, slo: SLO) -> None:
        self.slo = slo
        self.itl: tuple[list[float], list[float]] = ([], [])
        self.heap: list[tuple[float, int, int, Instance | SimRequest | None]] = []
        self.seq = 0
        self.cluster, self.dep = cluster, dep
        self.finished: list[SimRequest] = []
        self.judged = self.misses = 0
        # The serving path: a request reaches an instance this long after it was sent.
        self.request_delay = cluster.overhead(dep.mode).request_s

        def make(name: str, role: str, tp: int, budget: int) -> Instance:
            lat = cluster.latency(tp, dep.mode)
            inst = Instance(name, role, lat, budget, dep.max_num_seqs, self.itl)
            inst.link_bw, inst.finished = cluster.link.instance_bytes_per_s(tp), self.finished
            return inst

        if dep.mode == "colocated":
            chunked = dep.chunk or budget
            self.front = [make(f"c{i}", "both", dep.tp, chunked) for i in range(dep.replicas)]
            self.decoders: list[Instance] = []
        else:
            self.front = [make(f"p{i}", "prefill", dep.prefill_tp, dep.chunk or budget)
                          for i in range(dep.num_prefill)]  # fmt: skip
            # Conditional disaggregation: decode instances also prefill short prompts.
            local = dep.local_prefill_threshold > 0
            d_budget = dep.decode_chunk or dep.chunk or budget
            role, d_budget = ("both", d_budget) if local else ("decode", 1)
            self.decoders = [
                make(f"d{i}", role, dep.decode_tp, d_budget) for i in range(dep.num_decode)
            ]
            if dep.decode_chunk:  # as the engine: chunked only beside running streams
                for d in self.decoders:
                    d.idle_budget = budget
        self.fabric = Fabric(cluster.link, cluster.model.num_layers)
        self.kv_per_token = cluster.wire_bytes(1)  # on the wire
        self.fabric_version = 0
        # Requests sent to the prefill pool whose first token has not come back: the router's
        # "prefill pool busy" (it counts them until the KV has landed, not just until computed).
        self.remote_pending = 0

    # -- scheduling ------------------------------------------------------------------------
    def push(self, t: float, kind: int, inst: Instance | SimRequest | None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, inst))

    def schedule(self, inst: Instance, now: float, end: float) -> None:
        inst.version += 1
        inst.busy_until, inst.op_start = end, now
        self.push(end, inst.version, inst)

    def start(self, inst: Instance, now: float) -> None:
        plan = inst.plan()
        if plan is not None:
            parts, batch = plan
            dt = inst.lat.iteration(batch)
            inst.current = parts, dt
            if inst.role == "prefill":
                for r, n in parts:
                    if r.done + n == r.prompt:
                        self.fabric.start(now, r, inst, self.kv_per_token * r.prompt, dt)
                self.reschedule_fabric()
            self.schedule(inst, now, now + dt)
        elif inst.num_running:
            co = inst.lat.decode_coeffs(inst.num_running, inst.ctx_sum)
            k = inst.steps_to_next_finish()
            inst.stretch = (now, k, co)
            self.schedule(inst, now, now + stretch_time(co, k))
        else:
            inst.busy_until = None

    def poke(self, inst: Instance, now: float) -> None:
        """New work for `inst`: start it if idle, or cut its decode stretch short."""
        if inst.busy_until is None:
            self.start(inst, now)
        elif inst.stretch is not None and inst.wants_boundary():
            start, k, co = inst.stretch
            k2, end = _stretch_boundary(inst.stretch, now)
            if k2 < k:
                inst.stretch = (start, k2, co)
                self.schedule(inst, start, end)

    def reschedule_fabric(self) -> None:
        t = self.fabric.next_time()
        self.fabric_version += 1
        if t is not None:
            self.push(t, self.fabric_version, None)

    # -- events ----------------------------------------------------------------------------
    def arrive(self, r: SimRequest, now: float) -> None:
        if self.dep.mode == "colocated":
            inst = min(self.front, key=_decode_cost)
        elif r.prompt < self.dep.local_prefill_threshold and not (
            self.dep.short_prefills_to_idle_pool and self.remote_pending == 0
        ):
            inst = min(self.decoders, key=_decode_cost)
        else:
            # Remote prefill: the router first asks the decode instance for blocks (Admit ->
            # Placement), which its worker answers between two steps; the prompt reaches the
            # prefill pool then.
            self.remote_pending += 1
            r.decoder = min(self.decoders, key=_decode_cost)
            r.decoder.inbound += 1
            placed = self.next_boundary(r.decoder, now)
            if placed > now:
                self.push(placed, 0, r)
            else:
                self.to_prefill(r, now)
            return
        inst.enqueue(r)
        self.poke(inst, now)

    def to_prefill(self, r: SimRequest, now: float) -> None:
        """`r` (placed on its decoder) joins the prefill pool's least-loaded instance."""
        inst = r.prefiller = min(self.front, key=lambda i: i.queued_tokens)
        inst.enqueue(r)
        self.poke(inst, now)

    @staticmethod
    def next_boundary(inst: Instance, now: float) -> float:
        """When `inst` next finishes a step (now if idle)."""
        if inst.busy_until is None:
            return now
        if inst.stretch is None:
            return inst.busy_until
        return _stretch_boundary(inst.stretch, now)[1]

    def instance_done(self, inst: Instance, now: float) -> None:
        inst.busy_time += now - inst.op_start
        if inst.stretch is not None:
            inst.finish_stretch(now)
        else:
            parts, dt = inst.current
            completed = inst.finish_iteration(parts, now, dt)
            if inst.role == "prefill":
                for r in completed:
                    self.fabric.prefill_done(now, r)
                self.reschedule_fabric()
        self.start(inst, now)

    def fabric_done(self, now: float) -> None:
        for r in self.fabric.complete(now):
            self.remote_pending -= 1
            self.first_token(r, now)
            r.prefiller.free_prefill(r)
            self.poke(r.prefiller, now)  # freed memory may admit a waiting prompt
            r.decoder.inbound -= 1
            r.decoder.receive(r)
            self.poke(r.decoder, now)
        self.reschedule_fabric()

    def count_misses(self) -> int:
        """SLO misses so far: late first tokens, then finished requests (each counted once)."""
        slo = self.slo
        for r in self.finished[self.judged :]:
            if r.missed:
                continue
            slow = r.output > 1 and r.finish - r.first_token > slo.tpot_s * (r.output - 1)
            self.misses += slow or r.first_token - r.arrival > slo.ttft_s
        self.judged = len(self.finished)
        return self.misses

    def first_token(self, r: SimRequest, now: float) -> None:
        """Disaggregated: the KV has landed, so the first token reaches the client now."""
        r.first_token = now
        if now - r.arrival > self.slo.ttft_s:
            r.missed = True
            self.misses += 1

    def run(self, requests: list[SimRequest], max_misses: int | None) -> None:
        """Process every arrival and event until nothing is left, or stop once more than
        `max_misses` requests have missed the SLO (the outcome is then already known)."""
        heap, i, n, delay = self.heap, 0, len(requests), self.request_delay
        while i < n or heap:
            if i < n and (not heap or requests[i].arrival + delay <= heap[0][0]):
                r = requests[i]
                i += 1
                self.arrive(r, r.arrival + delay)
                continue
            now, _, version, inst = heapq.heappop(heap)
            if isinstance(inst, SimRequest):  # placed on its decoder: on to the prefill pool
                self.to_prefill(inst, now)
            elif inst is None:
                if version != self.fabric_version:
                    continue
                self.fabric_done(now)
            elif version == inst.version:
                self.instance_done(inst, now)
            else:
                continue
            if max_misses is not None and self.count_misses() > max_misses:
                return


def simulate(
    cluster: Cluster, dep: Deployment, requests: list[RequestSpec], slo: SLO,
    stop_after_misses: int | None = None,
) -> SimResult:  # fmt: skip
    """Simulate `dep` on `cluster` serving `requests`; records and aggregates like bench's.

    With `stop_after_misses`, the run stops once more requests than that have missed the SLO;
    requests not finished by then are reported with status "timeout" (they count as misses).
    """
    longest = max((r.prompt_tokens for r in requests), default=1)
    loop = _Loop(cluster, dep, max(dep.max_batched_tokens, longest), slo)
    sims = [SimRequest(r.index, r.klass, r.arrival_s, r.prompt_tokens, r.output_tokens)
            for r in sorted(requests, key=lambda r: r.arrival_s)]  # fmt: skip
    servable = _servable(loop, sims)
    loop.run(servable, stop_after_misses)
    ok = {r.index for r in servable}
    records = [_record(r, r.index in ok) for r in sims]
    duration = max((r.finish for r in loop.finished), default=0.0)
    aggregates = summarize(records, slo, duration)
    aggregates["itl_s"] = weighted_stats(*loop.itl)
    util = {"prefill" if dep.mode == "disagg" else "colocated": _busy(loop.front, duration)}
    if loop.decoders:
        util["decode"] = _busy(loop.decoders, duration)
    return SimResult(records, aggregates, util, loop.fabric.bytes_sent)


def _stretch_boundary(stretch: tuple, now: float) -> tuple[int, float]:
    """(steps done, time) at the first step boundary at or after `now` in a decode stretch."""
    start, k, co = stretch
    steps = steps_to_reach(co, now - start, k)
    return steps, start + stretch_time(co, steps)


def _servable(loop: _Loop, sims: list[SimRequest]) -> list[SimRequest]:
    """Requests whose KV fits every instance; the others fail (their finish stays None)."""
    insts = loop.front + loop.decoders
    return [r for r in sims if all(inst.fits(r) for inst in insts)]


def _record(r: SimRequest, servable: bool) -> RequestRecord:
    if r.finish is None:
        status, error = "timeout", "the simulation stopped early: the SLO was already missed"
        if not servable:
            status, error = "error", f"{r.reserve} tokens of KV do not fit in an instance"
        return RequestRecord(
            index=r.index, klass=r.klass, status=status, arrival_s=r.arrival,
            start_s=r.arrival, prompt_tokens=r.prompt, error=error,
        )  # fmt: skip
    ttft, e2e = r.first_token - r.arrival, r.finish - r.arrival
    return RequestRecord(
        index=r.index, klass=r.klass, status="ok", arrival_s=r.arrival, start_s=r.arrival,
        ttft_s=ttft, e2e_s=e2e, tpot_s=tpot(ttft, e2e, r.output),
        prompt_tokens=r.prompt, output_tokens=r.output,
    )  # fmt: skip


def _busy(insts: list[Instance], duration: float) -> float:
    if duration <= 0 or not insts:
        return 0.0
    return sum(i.busy_time for i in insts) / (duration * len(insts))


def _decode_cost(inst: Instance) -> tuple[int, int]:
    """The router's choice of decode instance: fewest prompt tokens queued for its own prefill,
    then fewest requests (those whose KV is still on its way included)."""
    return inst.queued_tokens, inst.load + inst.inbound
