"""One simulated engine instance (a tensor-parallel group), scheduling like pdserve's engine.

Queues a request moves through:
    role both:    waiting -> prefilling -> running -> finished
    role prefill: waiting -> prefilling -> (handed to the KV fabric)
    role decode:  ready (KV landed) -> running -> finished
A "both" instance in a disaggregated deployment (conditional disaggregation) takes both paths:
short prompts it prefills itself, long ones arrive through `ready`.

Each iteration takes every running sequence (one decode token each) plus prefill tokens, first
for partly prefilled prompts and then for waiting ones, within the token budget (the chunk size,
or a budget that fits whole prompts when chunking is off), the sequence cap and KV memory.
Memory for a request's prompt + output is reserved on admission (no preemption).

Decode is not simulated token by token: while the batch does not change, the instance runs a
*stretch* of k identical decode steps whose total time is a closed form (`stretch_time`). A
stretch ends at the next finish; an arrival that could join cuts it at the next step boundary.
Running requests advance a shared step counter, so finishing needs no per-token work.
"""

from __future__ import annotations

import heapq
from collections import deque

from pdserve.sim.latency import Batch, LatencyModel, stretch_time


class SimRequest:
    """A request's timeline in the simulation (times in seconds from the run's start)."""

    __slots__ = (
        "index", "klass", "arrival", "prompt", "output", "done", "first_token", "finish",
        "decoder", "prefiller", "missed",
    )  # fmt: skip

    def __init__(self, index: int, klass: str, arrival: float, prompt: int, output: int):
        self.index, self.klass, self.arrival = index, klass, arrival
        self.prompt, self.output = prompt, output
        self.done = 0  # prompt tokens computed
        self.first_token: float | None = None
        self.finish: float | None = None
        self.decoder: Instance | None = None  # disaggregated: where decode will run
        self.prefiller: Instance | None = None  # disaggregated: where prefill ran
        self.missed = False  # already counted as an SLO miss

    @property
    def reserve(self) -> int:
        return self.prompt + self.output


class Instance:
    """An engine with a role ("both", "prefill", "decode") driven by the simulator's clock."""

    def __init__(
        self, name: str, role: str, latency: LatencyModel, budget: int, max_num_seqs: int,
        itl: tuple[list[float], list[float]],
    ) -> None:  # fmt: skip
        self.name, self.role, self.lat = name, role, latency
        self.budget, self.max_num_seqs = budget, max_num_seqs
        # A disaggregated decode worker chunks its own prefills only while streams run: with
        # none, it computes them within this budget instead (None: always `budget`).
        self.idle_budget: int | None = None
        self.capacity = latency.kv_capacity_tokens
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.ready: deque[SimRequest] = deque()
        self.finishing: list[tuple[int, int, SimRequest]] = []  # heap of (finish step, index, r)
        self.joined: list[SimRequest] = []  # joined since the last step (their first gap differs)
        self.ctx_sum = 0  # cached tokens of running sequences
        self.steps = 0
        self.kv_used = 0
        self.queued_tokens = 0  # uncomputed prompt tokens waiting or prefilling
        self.busy_until: float | None = None  # end of the current iteration or stretch
        self.op_start = 0.0
        self.current: tuple[list[tuple[SimRequest, int]], float] = ([], 0.0)  # parts, seconds
        self.inbound = 0  # decode role: requests routed here whose KV has not landed
        self.link_bw = 0.0  # bytes/s this instance can send or receive KV at (set by the loop)
        self.finished: list[SimRequest] = []  # shared with the loop, to judge SLOs as it goes
        self.version = 0
        self.stretch: tuple[float, int, object] | None = None  # (start, steps, coeffs)
        self.busy_time = 0.0
        self._itl_values, self._itl_weights = itl

    # -- load and admission -------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.finishing)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.ready) + self.num_running

    def _need(self, r: SimRequest) -> int:
        """KV tokens `r` holds here: a prefill instance keeps only the prompt."""
        return r.prompt if self.role == "prefill" else r.reserve

    def fits(self, r: SimRequest) -> bool:
        """Whether `r` could ever be admitted (its KV alone fits in memory)."""
        return self._need(r) <= self.capacity

    def _can_admit(self, r: SimRequest) -> bool:
        seqs = self.num_running + len(self.prefilling)
        return seqs < self.max_num_seqs and self.kv_used + self._need(r) <= self.capacity

    def wants_boundary(self) -> bool:
        """True when queued work could join at the next step boundary (cut a stretch)."""
        heads = [q[0] for q in (self.ready, self.waiting) if q]
        return any(self._can_admit(r) for r in heads)

    # -- one iteration --------------------------------------------------------------------
    def plan(self) -> tuple[list[tuple[SimRequest, int]], Batch] | None:
        """Admit what fits and return (prefill parts, batch) for a mixed iteration, or None
        when only decoding is left (the caller then runs a stretch)."""
        self._admit_ready()
        if self.role == "decode":
            return None
        budget = self.budget
        if self.idle_budget is not None and self.num_running == 0:
            budget = self.idle_budget
        remain = budget - self.num_running
        parts: list[tuple[SimRequest, int]] = []
        for r in self.prefilling:
            if remain <= 0:
                break
            n = min(r.prompt - r.done, remain)
            parts.append((r, n))
            remain -= n
        while self.waiting and remain > 0 and self._can_admit(self.waiting[0]):
            r = self.waiting.popleft()
            self.prefilling.append(r)
            self.kv_used += self._need(r)
            n = min(r.prompt, remain)
            parts.append((r, n))
            remain -= n
        if not parts:
            return None
        b = self.num_running
        tokens = sum(n for _, n in parts)
        pairs = sum(n * (r.done + n / 2) for r, n in parts)
        prior = sum(r.done for r, _ in parts)
        sampled = b + sum(r.done + n == r.prompt for r, n in parts)
        batch = Batch(
            b + tokens, sampled, self.ctx_sum + pairs, self.ctx_sum + prior, b + len(parts)
        )
        return parts, batch

    def enqueue(self, r: SimRequest) -> None:
        """A request that needs prefill here."""
        self.waiting.append(r)
        self.queued_tokens += r.prompt

    def receive(self, r: SimRequest) -> None:
        """Decode role: `r`'s KV has landed; it joins at the next boundary memory allows."""
        self.ready.append(r)

    def _admit_ready(self) -> None:
        while self.ready and self._can_admit(self.ready[0]):
            r = self.ready.popleft()
            self.kv_used += r.reserve
            self._join(r)

    def _join(self, r: SimRequest) -> None:
        """`r` has its first token and its KV here: it decodes from the next step on."""
        if r.output <= 1:
            self._release(r, r.first_token)
            return
        heapq.heappush(self.finishing, (self.steps + r.output - 1, r.index, r))
        self.ctx_sum += r.prompt + 1
        self.joined.append(r)

    def finish_iteration(self, parts, now: float, dt: float) -> list[SimRequest]:
        """Book a mixed iteration ending at `now`; returns requests whose prefill completed."""
        self._advance(1, now, dt, dt)
        completed = []
        for r, n in parts:
            r.done += n
            self.queued_tokens -= n
            if r.done == r.prompt:
                completed.append(r)
        if completed:
            self.prefilling = [r for r in self.prefilling if r.done < r.prompt]
        if self.role == "both":
            for r in completed:
                r.first_token = now
                self._join(r)  # its TTFT is judged when it finishes
        return completed

    def finish_stretch(self, now: float) -> None:
        start, k, co = self.stretch
        first = stretch_time(co, 1)
        self._advance(k, now, first, (now - start - first) / (k - 1) if k > 1 else 0.0)
        self.stretch = None

    def _advance(self, k: int, now: float, first: float, rest: float) -> None:
        """k decode steps ended at `now`: record gaps, retire finished sequences."""
        b = self.num_running
        if b:
            first_end = now - rest * (k - 1)
            newcomers = self.joined
            self._itl_values.append(first)
            self._itl_weights.append(b - len(newcomers))
            for r in newcomers:
                self._itl_values.append(first_end - r.first_token)
                self._itl_weights.append(1)
            if k > 1:
                self._itl_values.append(rest)
                self._itl_weights.append(b * (k - 1))
            self.ctx_sum += b * k
        self.joined = []
        self.steps += k
        while self.finishing and self.finishing[0][0] <= self.steps:
            _, _, r = heapq.heappop(self.finishing)
            self.ctx_sum -= r.prompt + r.output
            self._release(r, now)

    def _release(self, r: SimRequest, now: float) -> None:
        r.finish = now
        self.kv_used -= r.reserve
        self.finished.append(r)

    def free_prefill(self, r: SimRequest) -> None:
        """Prefill role: the prompt's KV has left for the decoder."""
        self.kv_used -= r.prompt

    def steps_to_next_finish(self) -> int:
        return self.finishing[0][0] - self.steps
