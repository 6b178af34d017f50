"""Discrete-event simulation of a deployment serving a list of requests.

Deployments: co-located continuous batching (whole prompts per step), co-located with chunked
prefill, and disaggregated P:D pools with their own TP degrees joined by the KV `Fabric`.
Arrivals are routed like pdserve's router: co-located and decode instances by fewest prompt
tokens queued for their own prefill, then least outstanding requests; prefill instances by
fewest queued prompt tokens. Events are instance iteration or
decode-stretch ends, fabric completions, remote prompts reaching the prefill pool once their
decode instance has placed them (between two of its steps) and `Timer` callbacks (the pools'
resizing in `pdserve.sim.scaling`), in a heap; arrivals are merged in from their sorted list.
A calibrated serving path (`Cluster.serving`) delays every arrival by
its per-request overhead and lengthens every iteration by its per-step and per-sequence ones.
The output is bench's `RequestRecord`s and `summarize` aggregates, so simulated and measured
runs share one JSON shape.

Over 300 lines on purpose: one event loop whose handlers share the pools' state; the pieces
that stand alone (latency model, fabric, instances, scaling) are modules of their own.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
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


class Timer(NamedTuple):
    """A callback the loop runs at its time, between events; it may add instances and events."""

    fire: Callable[[float], None]


class Loop:
    """The event loop state; one per run (`simulate`; `pdserve.sim.scaling` extends it)."""

    def __init__(self, cluster: Cluster, dep: Deployment, budget: int, slo: SLO) -> None:
        self.slo = slo
        self.itl: tuple[list[float], list[float]] = ([], [])
        self.heap: list[tuple[float, int, int, Instance | SimRequest | Timer | None]] = []
        self.seq = 0
        self.cluster, self.dep, self.budget = cluster, dep, budget
        self.finished: list[SimRequest] = []
        self.judged = self.misses = 0
        # The serving path: a request reaches an instance this long after it was sent.
        self.request_delay = cluster.overhead(dep.mode).request_s
        if dep.mode == "colocated":
            self.front = [self.new_instance("colocated", i) for i in range(dep.replicas)]
            self.decoders: list[Instance] = []
        else:
            self.front = [self.new_instance("prefill", i) for i in range(dep.num_prefill)]
            self.decoders = [self.new_instance("decode", i) for i in range(dep.num_decode)]
        self.fabric = Fabric(cluster.link, cluster.model.num_layers)
        self.kv_per_token = cluster.wire_bytes(1)  # on the wire
        self.fabric_version = 0
        # Requests sent to the prefill pool whose first token has not come back: the router's
        # "prefill pool busy" (it counts them until the KV has landed, not just until computed).
        self.remote_pending = 0

    def new_instance(self, pool: str, index: int) -> Instance:
        """Instance `index` of `pool` ("colocated", "prefill" or "decode") as `dep` lays it out."""
        dep, budget, pp, shared = self.dep, self.budget, 1, False
        if pool == "colocated":
            name, role, tp, budget = f"c{index}", "both", dep.tp, dep.chunk or budget
            gpu, ep = dep.gpu, 1
        elif pool == "prefill":
            name, role, tp, budget = f"p{index}", "prefill", dep.prefill_tp, dep.chunk or budget
            gpu, ep, pp = dep.prefill_gpu, dep.prefill_ep, dep.prefill_pp
            shared = dep.prefill_pp_shared
        elif dep.local_prefill_threshold > 0:  # conditional disaggregation: D prefills short ones
            name, role, tp = f"d{index}", "both", dep.decode_tp
            budget = dep.decode_chunk or dep.chunk or budget
            gpu, ep = dep.decode_gpu, dep.decode_ep
        else:
            name, role, tp, budget = f"d{index}", "decode", dep.decode_tp, 1
            gpu, ep = dep.decode_gpu, dep.decode_ep
        lat = self.cluster.latency(tp, dep.mode, gpu, ep, pp, shared)
        inst = Instance(name, role, lat, budget, dep.max_num_seqs, self.itl)
        # Each end's own link; a flow runs at the slower end's share (`Fabric._rerate`). A
        # pipeline's stages each push their own layers' KV over their own devices' ports.
        inst.link_bw = self.cluster.device(gpu).link.instance_bytes_per_s(lat.devices)
        inst.finished = self.finished
        if pool == "decode" and dep.decode_chunk:  # as the engine: chunked only beside streams
            inst.idle_budget = self.budget
        return inst

    # -- scheduling ------------------------------------------------------------------------
    def push(self, t: float, kind: int, inst: Instance | SimRequest | Timer | None) -> None:
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
                for r, n in parts:  # each chunk's KV goes as it is computed
                    final = r.done + n == r.prompt
                    self.fabric.chunk(now, r, inst, self.kv_per_token * n, dt, final)
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
                for r, _ in parts:
                    if r.done < r.prompt:
                        self.fabric.chunk_done(now, r)
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
            elif isinstance(inst, Timer):
                inst.fire(now)
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
    loop = Loop(cluster, dep, token_budget(dep, requests), slo)
    sims = sim_requests(requests)
    ready = servable(loop, sims)
    loop.run(ready, stop_after_misses)
    records, aggregates = outcome(loop, sims, ready)
    duration = aggregates["duration_s"]
    util = {"prefill" if dep.mode == "disagg" else "colocated": _busy(loop.front, duration)}
    if loop.decoders:
        util["decode"] = _busy(loop.decoders, duration)
    return SimResult(records, aggregates, util, loop.fabric.bytes_sent)


def token_budget(dep: Deployment, requests: list[RequestSpec]) -> int:
    """The per-step token budget without chunking: enough for the longest prompt."""
    longest = max((r.prompt_tokens for r in requests), default=1)
    return max(dep.max_batched_tokens, longest)


def sim_requests(requests: list[RequestSpec]) -> list[SimRequest]:
    """`requests` as the loop's timelines, in order of arrival."""
    return [SimRequest(r.index, r.klass, r.arrival_s, r.prompt_tokens, r.output_tokens)
            for r in sorted(requests, key=lambda r: r.arrival_s)]  # fmt: skip


def outcome(loop: Loop, sims: list[SimRequest], ready: list[SimRequest]) -> tuple[list, dict]:
    """Bench's records of `sims` (those not in `ready` failed) and `summarize` aggregates, the
    duration up to the last finish and the pooled inter-token latencies included."""
    ok = {r.index for r in ready}
    records = [_record(r, r.index in ok) for r in sims]
    duration = max((r.finish for r in loop.finished), default=0.0)
    aggregates = summarize(records, loop.slo, duration)
    aggregates["itl_s"] = weighted_stats(*loop.itl)
    return records, aggregates


def _stretch_boundary(stretch: tuple, now: float) -> tuple[int, float]:
    """(steps done, time) at the first step boundary at or after `now` in a decode stretch."""
    start, k, co = stretch
    steps = steps_to_reach(co, now - start, k)
    return steps, start + stretch_time(co, steps)


def servable(loop: Loop, sims: list[SimRequest]) -> list[SimRequest]:
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
