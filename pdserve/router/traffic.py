"""What the autoscaler sees of the traffic (`pdserve serve --autoscale`): each arrival's prompt
and output length, and the TTFT and TPOT its client saw, over a sliding window.

Refused requests count as arrivals: they are demand the pools did not serve. An arrival whose
output is not known yet (still running, or refused) counts the median output of the requests
finished in the history, at most its `max_tokens` (`UNKNOWN_OUTPUT` before any finished)."""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

import numpy as np

from pdserve.bench.metrics import stats

UNKNOWN_OUTPUT = 256  # output tokens assumed before any request has finished
HISTORY_S = 600.0  # how far back it keeps arrivals and finished requests


class Arrival:
    __slots__ = ("at", "prompt", "max_tokens", "output")

    def __init__(self, at: float, prompt: int, max_tokens: int) -> None:
        self.at, self.prompt, self.max_tokens = at, prompt, max_tokens
        self.output: int | None = None  # once finished


class TrafficWindow(NamedTuple):
    lengths: list[tuple[int, int]]  # (prompt, output) tokens per arrival
    ttft_p90: float | None  # of the first tokens that came in the window
    tpot_p90: float | None  # of the requests that finished in it


class Traffic:
    def __init__(self, history_s: float = HISTORY_S) -> None:
        self.history_s = history_s
        self.arrivals: deque[Arrival] = deque()
        self.first_tokens: deque[tuple[float, float]] = deque()  # (when, ttft)
        self.finishes: deque[tuple[float, float | None, int]] = deque()  # (when, tpot, output)

    def arrived(self, prompt_tokens: int, max_tokens: int, now: float | None = None) -> Arrival:
        a = Arrival(time.monotonic() if now is None else now, prompt_tokens, max_tokens)
        self.arrivals.append(a)
        self._trim(a.at)
        return a

    def finished(
        self, arrival: Arrival | None, ttft: float | None, tpot: float | None, output: int,
        now: float | None = None,
    ) -> None:  # fmt: skip
        """A request ended: its first token came `ttft` after it arrived (None: never)."""
        now = time.monotonic() if now is None else now
        if arrival is not None:
            arrival.output = output
        if ttft is not None:
            self.first_tokens.append((now, ttft))
        self.finishes.append((now, tpot, output))
        self._trim(now)

    def window(self, window_s: float, now: float | None = None) -> TrafficWindow:
        now = time.monotonic() if now is None else now
        since = now - window_s
        outputs = [o for _, _, o in self.finishes]
        typical = int(np.median(outputs)) if outputs else UNKNOWN_OUTPUT
        lengths = [
            (a.prompt, a.output if a.output is not None else max(1, min(a.max_tokens, typical)))
            for a in self.arrivals
            if a.at >= since
        ]
        ttfts = [t for at, t in self.first_tokens if at >= since]
        tpots = [t for at, t, _ in self.finishes if at >= since and t is not None]
        return TrafficWindow(lengths, stats(ttfts)["p90"], stats(tpots)["p90"])

    def _trim(self, now: float) -> None:
        old = now - self.history_s
        for q in (self.arrivals, self.first_tokens, self.finishes):
            while q and (q[0].at if isinstance(q[0], Arrival) else q[0][0]) < old:
                q.popleft()
