"""`pdserve serve --autoscale`: the loop that sizes the prefill and decode pools while serving.

Every `--scale-interval` seconds `AutoscaleLoop.tick` observes (the router's `Traffic`: arrivals
with their lengths, refused ones too, and the TTFT/TPOT p90 clients saw; the prompt tokens
queued for prefill; the live, draining and starting workers), refits the simulator's latency
model to the speeds workers measure and report in heartbeats (`sim.calibration.calibrated`), and
asks the policy (`sim.autoscale.Autoscaler`, which simulates candidate P:D counts) for the
counts to run. It acts through the launcher: a new worker is started (local process or Ray
actor) and counts as "starting" until it has warmed up and registered, and only then receives
requests; a worker to remove is drained (`Worker.drain`: no new requests, it finishes what it
holds, then leaves). Each decision is logged with its reasons in numbers, printed when it
changes the pools, shown in `GET /health` ("autoscale") and exported as metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from pdserve.bench.metrics import SLO
from pdserve.flags import config_values
from pdserve.launch.flags import SCALE_FLAGS
from pdserve.router import metrics
from pdserve.sim.autoscale import Autoscaler, Observation
from pdserve.sim.calibration import calibrated
from pdserve.sim.deployment import Cluster, Deployment, Device
from pdserve.sim.hardware import Accelerator, Link
from pdserve.sim.latency import Efficiency
from pdserve.sim.scale_policy import ScaleBounds, ScalePolicy

log = logging.getLogger("pdserve.autoscale")
ROLES = ("prefill", "decode")
# Before any worker has measured its speed: a device of this order (a few CPU cores); the
# first measurements replace it (`calibrated`).
NOMINAL_FLOPS, NOMINAL_BYTES_S = 1e11, 2e10
LOOPBACK_GBPS = 20.0  # KV link between workers of one host (tcp over loopback)
# Two speeds are measured (prefill tokens/s, seconds per decode step), so the model keeps two
# free parameters: no fixed cost per step and no small-batch GEMM penalty, which would otherwise
# put a floor under the decode step that no bandwidth could fit.
LIVE_EFFICIENCY = Efficiency(mfu=1.0, mbu=1.0, iteration_overhead_s=0.0, half_tokens=0.0)


def live_cluster(model_config) -> Cluster:
    """The simulator's view of this deployment before calibration: the served model's shape on
    a nominal device per pool, "prefill" and "decode" (`calibrated` fits each to what its own
    workers measure: the pools may run on different hardware, threads or weight formats, and a
    grown pool keeps its own)."""
    from pdserve.sim.models import from_engine_config

    mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    accel = Accelerator(
        "served", "calibrated online to the workers' measured speeds", NOMINAL_FLOPS,
        NOMINAL_BYTES_S, mem, tp_link="pcie-gen4", max_tp=1,
    )  # fmt: skip
    link = Link.from_gbps(LOOPBACK_GBPS)
    devices = {role: Device(replace(accel, name=f"served-{role}"), LIVE_EFFICIENCY, "bf16", link)
               for role in ROLES}  # fmt: skip
    return Cluster(from_engine_config(model_config, "served"), accel, link, LIVE_EFFICIENCY,
                   "bf16", "bf16", devices=devices)  # fmt: skip


class AutoscaleLoop:
    def __init__(
        self,
        frontend,
        autoscaler: Autoscaler,
        start: Callable[[str], str],
        drain: Callable[[str], None],
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.frontend, self.core = frontend, frontend.core
        self.autoscaler, self.policy = autoscaler, autoscaler.policy
        autoscaler.speeds_known = False  # until the workers have measured theirs (`calibrate`)
        self.start, self.drain = start, drain
        self.startup_timeout_s = startup_timeout_s
        self.starting: dict[str, tuple[str, float]] = {}  # worker id -> (role, since)
        self.started_at = time.monotonic()
        self.decisions = 0
        self.task: asyncio.Task | None = None

    def run(self) -> asyncio.Task:
        self.frontend.autoscale = {"decisions": 0, "starting": [], "reasons": []}
        self.task = asyncio.get_running_loop().create_task(self._loop())
        return self.task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            if self.frontend.draining:
                return  # serve is shutting down: the pools stay as they are
            try:
                await self.tick(time.monotonic())
            except Exception:
                log.exception("autoscaler tick failed; the pools stay as they are")

    # -- observing -------------------------------------------------------------------------
    def counts(self, now: float) -> dict[str, int]:
        """Workers per role that serve (live, not draining); forgets starting workers that
        registered, and drains those that did not within the startup timeout."""
        live = {r: [w for w in self.core.alive(r) if not w.draining] for r in ROLES}
        registered = {w.worker_id for ws in live.values() for w in ws}
        for wid, (_, since) in list(self.starting.items()):
            if wid in registered:
                del self.starting[wid]
            elif now - since > self.startup_timeout_s:
                del self.starting[wid]
                print(f"pdserve serve: autoscale: {wid} did not register within "
                      f"{self.startup_timeout_s:g} s; draining it", flush=True)  # fmt: skip
                self.drain(wid)
        return {r: len(live[r]) for r in ROLES}

    def observe(self, now: float) -> Observation:
        live = self.counts(now)
        starting = {r: sum(role == r for role, _ in self.starting.values()) for r in ROLES}
        window = min(self.policy.interval_s * 2, max(self.policy.interval_s, now - self.started_at))
        seen = self.frontend.traffic.window(window, now)
        queued = sum(w.queued_prefill_tokens() for w in self.core.alive())
        return Observation(
            window, seen.lengths, live["prefill"] + starting["prefill"],
            live["decode"] + starting["decode"], seen.ttft_p90, seen.tpot_p90, queued,
            starting["prefill"], starting["decode"],
        )  # fmt: skip

    def calibrate(self, obs: Observation) -> None:
        """Fit each pool's device in the simulator to the speeds that pool's workers measured
        (heartbeats): the prefill pool's from its prefills, the decode pool's from its decode
        steps and its own (short, local) prefills. A pool that has not measured a speed yet
        borrows the other's."""
        if not obs.lengths:
            return
        prompt = float(np.median([p for p, _ in obs.lengths]))
        output = float(np.median([o for _, o in obs.lengths]))
        speeds = {}
        for role in ROLES:
            loads = [w.load for w in self.core.alive(role) if w.load is not None]
            prefill = [ld.prefill_tok_s for ld in loads if ld.prefill_tok_s > 0]
            decoding = [ld for ld in loads if ld.decode_step_s > 0 and ld.running > 0]
            speeds[role] = (float(np.mean(prefill)) if prefill else None,
                            decoding[0] if decoding else None)  # fmt: skip
        if not any(tok_s or step for tok_s, step in speeds.values()):
            return
        a = self.autoscaler
        a.speeds_known = True
        for role, other in zip(ROLES, ROLES[::-1], strict=True):
            tok_s, step = speeds[role]
            tok_s, step = tok_s or speeds[other][0], step or speeds[other][1]
            gpu = role if role in a.cluster.devices else None
            a.cluster = calibrated(
                a.cluster, prompt, tok_s, step.running if step else 0, prompt + output / 2,
                step.decode_step_s if step else None, gpu=gpu,
            )  # fmt: skip

    # -- deciding and acting ---------------------------------------------------------------
    async def tick(self, now: float) -> None:
        obs = self.observe(now)
        self.calibrate(obs)
        decision = await asyncio.to_thread(self.autoscaler.decide, obs, now)
        self.decisions += 1
        before = (obs.prefill, obs.decode)
        text = decision.describe(before)
        log.info("autoscale: %s", text)
        for role, n in zip(ROLES, decision.target, strict=True):
            metrics.AUTOSCALE_TARGET.labels(role).set(n)
        if decision.predicted is not None:
            metrics.AUTOSCALE_PREDICTED.labels("ttft_p90").set(decision.predicted.ttft_p90)
            metrics.AUTOSCALE_PREDICTED.labels("tpot_p90").set(decision.predicted.tpot_p90)
        if (decision.prefill, decision.decode) != before:
            print(f"pdserve serve: autoscale: {text}", flush=True)
        self.apply(dict(zip(ROLES, (decision.prefill, decision.decode), strict=True)), obs)
        self.frontend.autoscale = {
            "prefill": decision.prefill, "decode": decision.decode,
            "target": list(decision.target), "starting": sorted(self.starting),
            "reasons": list(decision.reasons), "decisions": self.decisions,
            "predicted": decision.predicted._asdict() if decision.predicted else None,
        }  # fmt: skip

    def apply(self, want: dict[str, int], obs: Observation) -> None:
        have = {"prefill": obs.prefill, "decode": obs.decode}
        now = time.monotonic()
        for role in ROLES:
            for _ in range(want[role] - have[role]):
                wid = self.start(role)
                self.starting[wid] = (role, now)
                metrics.SCALE_EVENTS.labels(role, "up").inc()
            for wid in self.to_remove(role, have[role] - want[role]):
                self.drain(wid)
                metrics.SCALE_EVENTS.labels(role, "down").inc()

    def to_remove(self, role: str, n: int) -> list[str]:
        """The `n` workers of `role` to drain: those still starting first (nothing to finish),
        then those holding the fewest requests, the most recently added of equals."""
        if n <= 0:
            return []
        starting = [wid for wid, (r, _) in self.starting.items() if r == role][::-1][:n]
        for wid in starting:
            del self.starting[wid]
        live = [w for w in self.core.alive(role) if not w.draining]
        live.sort(key=lambda w: (len(w.inflight), -_index(w.worker_id)))
        return starting + [w.worker_id for w in live[: n - len(starting)]]


def _index(worker_id: str) -> int:
    """`decode-3` -> 3 (the launcher's naming); others sort first."""
    tail = worker_id.rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1


def make_autoscaler(args, model_config) -> Autoscaler:
    """The policy of `serve --autoscale`'s flags (checked: SLOs given, disaggregated mode)."""
    if args.mode != "disagg":
        raise ValueError("--autoscale sizes the prefill and decode pools: it needs --mode disagg")
    if args.slo_ttft is None or args.slo_tpot is None:
        raise ValueError("--autoscale needs its targets: give --slo-ttft and --slo-tpot (seconds)")
    bounds = ScaleBounds(args.prefill, args.max_prefill or args.prefill,
                         args.decode, args.max_decode or args.decode)  # fmt: skip
    policy = ScalePolicy(SLO(args.slo_ttft, args.slo_tpot), bounds,
                         **config_values(args, SCALE_FLAGS))  # fmt: skip
    base = Deployment(
        "disagg",
        max_num_seqs=args.max_num_seqs or Deployment.served("disagg").max_num_seqs,
        max_batched_tokens=Deployment.served("disagg").max_batched_tokens,
        local_prefill_threshold=args.local_prefill_threshold,
        short_prefills_to_idle_pool=not args.keep_short_prefills_local,
        decode_chunk=args.decode_chunk_size or None,
        prefill_gpu="prefill",  # each pool on its own device (`live_cluster`)
        decode_gpu="decode",
    )
    return Autoscaler(live_cluster(model_config), base, policy)
