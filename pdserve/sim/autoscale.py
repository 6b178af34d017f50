"""The autoscaler's policy: how many prefill and decode workers to run next, decided with the
simulator.

Each interval `Autoscaler.decide` gets an `Observation` (the requests that arrived in the last
window, admitted or refused, with their prompt and output lengths; the TTFT and TPOT p90 the
clients saw; prompt tokens queued for prefill; the worker counts) and:

1. predicts TTFT p90 and TPOT p90 for candidate P:D counts by simulating the observed load (the
   observed rate, Poisson arrivals, lengths resampled from the window) on each candidate
   (`pdserve.sim.simulate`, on a `Cluster` whose speeds the caller calibrates:
   `sim.calibration.calibrated`);
2. corrects each prediction by how far the same prediction for the counts now running was from
   what the clients saw (observed / predicted, smoothed and clamped, as Dynamo's SLA planner
   corrects its profile);
3. takes the cheapest counts (fewest devices) whose corrected predictions are within `headroom`
   of both SLOs: the fewest prefill workers that meet TTFT with the most decode workers, then
   the fewest decode workers that meet TPOT (and still TTFT) with those;
4. reacts to what prediction missed: a TTFT p90 over the SLO, or prompt tokens queued for
   prefill growing two intervals running, adds a prefill worker; a TPOT p90 over the SLO adds a
   decode worker;
5. grows at once, shrinks slowly: a pool shrinks only once its last change is `cooldown_s` old,
   and only to the most any decision of the last `cooldown_s` asked for.

Every `Decision` carries its reasons in numbers. The same class drives the live server
(`launch/autoscale.py`) and the simulated day (`benchmarks/autoscale.py`). Its settings are
`sim/scale_policy.py`; fitting a cluster to measured speeds is `sim.calibration.calibrated`.
A little over 300 lines: the five steps above are one policy, read in one class.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from pdserve.bench.metrics import stats
from pdserve.bench.workload import RequestSpec
from pdserve.sim.deployment import Cluster, Deployment
from pdserve.sim.scale_policy import ScaleBounds as ScaleBounds  # its users import it from here
from pdserve.sim.scale_policy import ScalePolicy
from pdserve.sim.simulator import simulate

CORRECTION_RANGE = (0.5, 4.0)  # observed / predicted beyond this is noise or a transient
CORRECTION_SMOOTHING = 0.5  # weight of the newest ratio
NO_BETTER = 1.05  # when no count meets a target: the fewest within 5 % of the most's p90


class Observation(NamedTuple):
    """What the autoscaler saw over the last `window_s` seconds."""

    window_s: float
    lengths: list[tuple[int, int]]  # (prompt, output) tokens of each arrival, refused ones too
    prefill: int  # workers live or starting now
    decode: int
    ttft_p90: float | None = None  # clients' first tokens in the window (None: none)
    tpot_p90: float | None = None
    queued_tokens: int = 0  # prompt tokens waiting for prefill, cluster-wide
    starting_prefill: int = 0  # of `prefill`, those not serving yet (loading, warming up)
    starting_decode: int = 0

    @property
    def live(self) -> tuple[int, int]:
        """Workers serving now, per pool."""
        return self.prefill - self.starting_prefill, self.decode - self.starting_decode

    @property
    def rate(self) -> float:
        return len(self.lengths) / self.window_s if self.window_s > 0 else 0.0


class Prediction(NamedTuple):
    ttft_p90: float
    tpot_p90: float


class SyntheticLoad(NamedTuple):
    """What a prediction simulates: the prompts queued now (at time 0, the first `backlog`),
    then the observed load continued. Its p90s leave out the requests that arrive in the
    first `warmup_s` (the batch is still filling), the backlog's included."""

    requests: list[RequestSpec]
    backlog: int
    warmup_s: float


class Decision(NamedTuple):
    prefill: int
    decode: int
    reasons: tuple[str, ...]
    predicted: Prediction | None  # corrected, for the chosen counts (None: no load)
    target: tuple[int, int]  # what the prediction alone asked for, before the cooldown

    def describe(self, before: tuple[int, int]) -> str:
        change = f"{before[0]}P+{before[1]}D -> {self.prefill}P+{self.decode}D"
        if (self.prefill, self.decode) == before:
            change = f"stay at {self.prefill}P+{self.decode}D"
        return f"{change}: " + "; ".join(self.reasons)


class Autoscaler:
    def __init__(
        self, cluster: Cluster, base: Deployment, policy: ScalePolicy, seed: int = 0
    ) -> None:
        if base.mode != "disagg":
            raise ValueError("the autoscaler sizes the prefill and decode pools of --mode disagg")
        self.cluster, self.base, self.policy = cluster, base, policy
        self.rng = np.random.default_rng(seed)
        self.correction = {"ttft": 1.0, "tpot": 1.0}
        self.targets: deque[tuple[float, int, int]] = deque()  # (time, prefill, decode)
        self.changed = {"prefill": -math.inf, "decode": -math.inf}  # last change per pool
        self.queued: deque[int] = deque(maxlen=3)
        self.prefill_tok_s = 0.0  # the prefill pool's, as the model predicts it (queue rule)
        # False while the cluster's speeds are not known yet (a live server before its workers
        # measured any): then it only reacts to what it observes
        self.speeds_known = True

    # -- prediction ------------------------------------------------------------------------
    def synthetic_load(self, obs: Observation) -> SyntheticLoad:
        """The prompts queued now, then the observed load continued: Poisson arrivals at the
        observed rate over the horizon, lengths drawn from the window's requests."""
        pol = self.policy
        prompt_p50 = max(1.0, float(np.median([p for p, _ in obs.lengths])))
        backlog = min(pol.max_sim_requests, round(obs.queued_tokens / prompt_p50))
        n = max(1, min(pol.max_sim_requests, round(obs.rate * pol.horizon_s)))
        times = np.concatenate(
            [np.zeros(backlog), np.cumsum(self.rng.exponential(1 / obs.rate, n))]
        )
        picks = self.rng.integers(0, len(obs.lengths), backlog + n)
        requests = [RequestSpec(i, float(t), "observed", *obs.lengths[k])
                    for i, (t, k) in enumerate(zip(times, picks, strict=True))]  # fmt: skip
        return SyntheticLoad(requests, backlog, float(times[-1]) / 4)

    def unloaded(self, obs: Observation) -> Prediction:
        """TTFT and TPOT of a typical request alone: what no pool size shortens."""
        p50 = [max(1, int(np.median(col))) for col in zip(*obs.lengths, strict=True)]
        one = SyntheticLoad([RequestSpec(0, 0.0, "alone", *p50)], 1, 0.0)
        return self.predict(min(1, self.policy.bounds.max_prefill), 1, one)

    def predict(self, prefill: int, decode: int, load: SyntheticLoad) -> Prediction:
        """Uncorrected TTFT and TPOT p90 of `load` on `prefill`P + `decode`D."""
        if prefill == 0:  # every prompt prefills on the decode workers
            dep = replace(
                self.base, num_prefill=1, num_decode=decode,
                local_prefill_threshold=10**9, short_prefills_to_idle_pool=False,
            )  # fmt: skip
        else:
            dep = replace(self.base, num_prefill=prefill, num_decode=decode)
        records = simulate(self.cluster, dep, load.requests, self.policy.slo).records
        judged = [r for r in records if r.index < load.backlog or r.arrival_s >= load.warmup_s]
        if not judged or any(not r.ok for r in judged):  # the KV does not fit: never good enough
            return Prediction(math.inf, math.inf)
        tpots = [r.tpot_s for r in judged if r.tpot_s is not None]
        return Prediction(stats([r.ttft_s for r in judged])["p90"], stats(tpots)["p90"] or 0.0)

    def corrected(self, p: Prediction, alone: Prediction) -> Prediction:
        """The correction scales what queueing and batching add to a request alone."""
        c = self.correction
        ttft = alone.ttft_p90 + max(0.0, p.ttft_p90 - alone.ttft_p90) * c["ttft"]
        tpot = alone.tpot_p90 + max(0.0, p.tpot_p90 - alone.tpot_p90) * c["tpot"]
        return Prediction(ttft, tpot)

    def update_correction(self, obs: Observation, now_pred: Prediction, alone: Prediction):
        """Move each correction toward observed / predicted (beyond a request alone) for the
        workers serving now."""
        notes = []
        pairs = (("ttft", obs.ttft_p90, now_pred.ttft_p90, alone.ttft_p90),
                 ("tpot", obs.tpot_p90, now_pred.tpot_p90, alone.tpot_p90))  # fmt: skip
        for key, seen, pred, base in pairs:
            if seen is None or not pred < math.inf or pred - base <= 0.01 * base:
                continue  # nothing observed, or no queueing predicted to compare with
            ratio = (seen - base) / (pred - base)
            clamped = min(CORRECTION_RANGE[1], max(CORRECTION_RANGE[0], ratio))
            w = CORRECTION_SMOOTHING
            self.correction[key] = (1 - w) * self.correction[key] + w * clamped
            notes.append(f"{key.upper()} p90 observed {seen:.3g} s, predicted {pred:.3g} s "
                         f"(correction x{self.correction[key]:.2f})")  # fmt: skip
        return notes

    # -- the decision ----------------------------------------------------------------------
    def decide(self, obs: Observation, now: float) -> Decision:
        b = self.policy.bounds
        self.queued.append(obs.queued_tokens)
        current = (obs.prefill, obs.decode)
        reasons: list[str] = []
        predicted = None
        if not obs.lengths:
            target = (b.min_prefill, b.min_decode)
            reasons.append(f"no arrivals in the last {obs.window_s:.0f} s")
        elif not self.speeds_known:
            target = b.clamp(*current)
            reasons.append(f"arrivals {obs.rate:.2f} req/s; no worker has measured its speed "
                           "yet, so nothing is predicted")  # fmt: skip
        else:
            load = self.synthetic_load(obs)
            alone = self.unloaded(obs)
            memo: dict[tuple[int, int], Prediction] = {}

            def pred(p: int, d: int) -> Prediction:
                if (p, d) not in memo:
                    memo[(p, d)] = self.predict(p, d, load)
                return self.corrected(memo[(p, d)], alone)

            p_in, l_in = (
                np.median([x[0] for x in obs.lengths]),
                np.median([x[1] for x in obs.lengths]),
            )
            reasons.append(f"arrivals {obs.rate:.2f} req/s (prompt p50 {p_in:.0f}, output p50 "
                           f"{l_in:.0f} tokens)")  # fmt: skip
            serving = b.clamp(*obs.live)  # the correction compares with workers that serve
            uncorrected = self.predict(*serving, load)
            memo[serving] = uncorrected
            reasons += self.update_correction(obs, uncorrected, alone)
            self.prefill_tok_s = obs.live[0] * p_in / max(alone.ttft_p90, 1e-9)
            target, predicted, why = self.search(pred)
            reasons.append(why)
        target = self.react(obs, target, reasons)
        chosen = self.cooled(target, current, now, reasons)
        if predicted is not None and chosen != target and obs.lengths:
            predicted = pred(*chosen)
        return Decision(*chosen, tuple(reasons), predicted, target)

    def search(self, pred) -> tuple[tuple[int, int], Prediction, str]:
        """The cheapest counts whose corrected p90s are within the headroom of both SLOs: the
        fewest prefill workers that meet TTFT (with the most decode workers), then the fewest
        decode workers that meet TPOT, and TTFT still, with those. A target no allowed count
        meets is given its largest pool; the other pool is still sized for its own target."""
        pol, b = self.policy, self.policy.bounds
        ttft_ok = pol.slo.ttft_s * pol.headroom
        tpot_ok = pol.slo.tpot_s * pol.headroom
        notes = []
        p = _first(range(b.min_prefill, b.max_prefill + 1),
                   lambda p: pred(p, b.max_decode).ttft_p90 <= ttft_ok)  # fmt: skip
        if p is None:  # the fewest that do about as well as the most (more would not help)
            best = pred(b.max_prefill, b.max_decode).ttft_p90
            p = _first(range(b.min_prefill, b.max_prefill + 1),
                       lambda p: pred(p, b.max_decode).ttft_p90 <= best * NO_BETTER)  # fmt: skip
            notes.append(f"even {b.max_prefill}P+{b.max_decode}D is predicted to miss TTFT: p90 "
                         f"{best:.2f} s > {ttft_ok:.2f} s; {p}P does about as well")  # fmt: skip
        elif p > b.min_prefill:
            notes.append(f"{p - 1}P: TTFT p90 {pred(p - 1, b.max_decode).ttft_p90:.2f} s")
        ttft_met = not notes or not notes[0].startswith("even")

        def meets(d: int) -> bool:
            q = pred(p, d)
            return q.tpot_p90 <= tpot_ok and (q.ttft_p90 <= ttft_ok or not ttft_met)

        d = _first(range(b.min_decode, b.max_decode + 1), meets)
        if d is None:
            best = pred(p, b.max_decode).tpot_p90
            d = _first(range(b.min_decode, b.max_decode + 1),
                       lambda d: pred(p, d).tpot_p90 <= best * NO_BETTER)  # fmt: skip
            notes.append(f"even {p}P+{b.max_decode}D is predicted to miss TPOT: p90 "
                         f"{best * 1e3:.0f} ms > {tpot_ok * 1e3:.0f} ms; {d}D does about as "
                         "well")  # fmt: skip
        elif d > b.min_decode:
            notes.append(f"{d - 1}D: TPOT p90 {pred(p, d - 1).tpot_p90 * 1e3:.0f} ms")
        best = pred(p, d)
        why = (f"{p}P+{d}D predicted TTFT p90 {best.ttft_p90:.2f} s (target <= {ttft_ok:.2f} s = "
               f"{pol.headroom:g} x SLO), TPOT p90 {best.tpot_p90 * 1e3:.0f} ms (target <= "
               f"{tpot_ok * 1e3:.0f} ms)")  # fmt: skip
        return (p, d), best, why + "".join(f"; {n}" for n in notes)

    def react(self, obs: Observation, target: tuple[int, int], reasons: list[str]):
        """Grow a pool whose observed latency misses the SLO although prediction did not ask."""
        b, slo = self.policy.bounds, self.policy.slo
        p, d = target
        grow_p = p <= obs.prefill and not obs.starting_prefill  # one step at a time
        if grow_p and obs.ttft_p90 is not None and obs.ttft_p90 > slo.ttft_s:
            p, grow_p = obs.prefill + 1, False
            reasons.append(f"observed TTFT p90 {obs.ttft_p90:.2f} s > SLO {slo.ttft_s:g} s")
        q = list(self.queued)
        # queued prompts grew three decisions running, past one TTFT SLO of the pool's work
        clears = slo.ttft_s * self.prefill_tok_s
        if grow_p and len(q) == 3 and q[0] < q[1] < q[2] and q[2] > clears > 0:
            p = obs.prefill + 1
            reasons.append(f"prompt tokens queued for prefill grew {q[0]} -> {q[1]} -> {q[2]} "
                           f"(> {clears:.0f}: {slo.ttft_s:g} s of the pool's prefill)")  # fmt: skip
        grow_d = d <= obs.decode and not obs.starting_decode
        if grow_d and obs.tpot_p90 is not None and obs.tpot_p90 > slo.tpot_s:
            d = obs.decode + 1
            reasons.append(f"observed TPOT p90 {obs.tpot_p90 * 1e3:.0f} ms > SLO "
                           f"{slo.tpot_s * 1e3:g} ms")  # fmt: skip
        clamped = b.clamp(p, d)
        if clamped != (p, d):
            reasons.append(f"bounded by {b.max_prefill}P+{b.max_decode}D at most, "
                           f"{b.min_prefill}P+{b.min_decode}D at least")  # fmt: skip
        return clamped

    def cooled(self, target, current, now: float, reasons: list[str]) -> tuple[int, int]:
        """Grow at once; shrink once the pool's last change is a cooldown old, to the most any
        decision of the last cooldown asked for."""
        cool = self.policy.cooldown_s
        self.targets.append((now, *target))
        while self.targets and self.targets[0][0] < now - cool:
            self.targets.popleft()
        held = now - self.targets[0][0] >= cool - self.policy.interval_s
        out = []
        for i, role in enumerate(("prefill", "decode")):
            want, have = target[i], current[i]
            if want > have:
                self.changed[role] = now
                out.append(want)
            elif want < have:
                highest = max(t[1 + i] for t in self.targets)
                if highest < have and held and now - self.changed[role] >= cool:
                    self.changed[role] = now
                    out.append(highest)
                else:
                    reasons.append(f"{role} pool would shrink to {want}; waits for the "
                                   f"{cool:g} s cooldown")  # fmt: skip
                    out.append(have)
            else:
                out.append(have)
        return tuple(out)


def _first(values, ok) -> int | None:
    """The first value for which `ok` holds (values in increasing order)."""
    for v in values:
        if ok(v):
            return v
    return None
