"""Synthetic workloads: length distributions, request classes, arrival processes.

Pure Python + numpy (no tokenizer), shared by the load generator (`pdserve bench`) and the
simulator (`pdserve.sim`), so both replay exactly the same requests for the same seed.

A `Workload` is a weighted mix of `RequestClass`es; each class draws prompt and output lengths
from its own `LengthDist`. `generate_requests` turns a workload, a count, a seed and an arrival
process into a list of `RequestSpec`s. Lengths and classes come from one random stream and
arrival times from another, so a rate sweep with one seed replays the *same* requests at each
rate and only their spacing changes.

A little over 300 lines: the types of a workload, its named mixes and the one generator that
bench and sim both draw their requests from, read together.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

_DIST_SYNTAX = "fixed:N, uniform:LOW,HIGH, lognormal:MEAN,SIGMA or a plain integer N"


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts; every sample is an integer >= 1.

    * ``fixed``: always ``mean`` tokens.
    * ``uniform``: integers in ``[low, high]``, both ends included.
    * ``lognormal``: arithmetic mean ``mean`` and log-space spread ``sigma``
      (mu = ln(mean) - sigma^2 / 2), optionally clipped to ``[low, high]``.
    """

    kind: str
    mean: float | None = None
    low: int | None = None
    high: int | None = None
    sigma: float | None = None

    def __post_init__(self) -> None:
        check = _CHECKS.get(self.kind)
        if check is None:
            raise ValueError(f"unknown length distribution {self.kind!r}; use {_DIST_SYNTAX}")
        check(self)

    @classmethod
    def fixed(cls, n: int) -> LengthDist:
        return cls("fixed", mean=n)

    @classmethod
    def uniform(cls, low: int, high: int) -> LengthDist:
        return cls("uniform", low=low, high=high)

    @classmethod
    def lognormal(
        cls, mean: float, sigma: float, low: int | None = None, high: int | None = None
    ) -> LengthDist:
        return cls("lognormal", mean=mean, sigma=sigma, low=low, high=high)

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """Parse ``"fixed:512"``, ``"512"``, ``"uniform:100,300"`` or ``"lognormal:1024,0.5"``.

        Raises ValueError naming the bad text and the accepted forms.
        """
        kind, _, args = text.strip().partition(":")
        if not args and kind.isdigit():
            kind, args = "fixed", kind
        want = {"fixed": 1, "uniform": 2, "lognormal": 2}.get(kind)
        if want is None:
            raise ValueError(f"bad length distribution {text!r}: use {_DIST_SYNTAX}")
        parts = [p.strip() for p in args.split(",")] if args else []
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != want:
            raise ValueError(
                f"bad length distribution {text!r}: {kind} takes {want} number(s); "
                f"use {_DIST_SYNTAX}"
            )
        if kind == "fixed":
            return cls.fixed(_as_int(values[0], text))
        if kind == "uniform":
            return cls.uniform(_as_int(values[0], text), _as_int(values[1], text))
        return cls.lognormal(values[0], values[1])

    def __str__(self) -> str:
        """The `parse` syntax (clip bounds of a lognormal appended as ``[low,high]``)."""
        if self.kind == "fixed":
            return f"fixed:{int(self.mean)}"
        if self.kind == "uniform":
            return f"uniform:{self.low},{self.high}"
        clip = f"[{self.low},{self.high}]" if self.low is not None or self.high is not None else ""
        return f"lognormal:{self.mean:g},{self.sigma:g}{clip}"

    @property
    def expected(self) -> float:
        """The mean number of tokens (clipping of a lognormal is ignored)."""
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        return float(self.mean)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` token counts as an int64 array, each >= 1 (and within [low, high] if set)."""
        if self.kind == "fixed":
            values = np.full(n, int(self.mean), dtype=np.int64)
        elif self.kind == "uniform":
            values = rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)
        else:
            mu = math.log(self.mean) - self.sigma**2 / 2
            values = np.rint(rng.lognormal(mu, self.sigma, size=n)).astype(np.int64)
        lo = max(1, self.low or 1)
        hi = self.high if self.high is not None else None
        return np.clip(values, lo, hi)


def _as_int(value: float, text: str) -> int:
    if value != int(value):
        raise ValueError(f"bad length distribution {text!r}: {value:g} is not a whole token count")
    return int(value)


def _check_fixed(d: LengthDist) -> None:
    if d.mean is None or d.mean < 1 or d.mean != int(d.mean):
        raise ValueError(f"fixed length must be a whole number >= 1, got {d.mean!r}")


def _check_uniform(d: LengthDist) -> None:
    if d.low is None or d.high is None or not 1 <= d.low <= d.high:
        raise ValueError(f"uniform lengths need 1 <= low <= high, got low={d.low} high={d.high}")


def _check_lognormal(d: LengthDist) -> None:
    if d.mean is None or d.mean < 1 or d.sigma is None or d.sigma < 0:
        raise ValueError(
            f"lognormal lengths need mean >= 1 and sigma >= 0, got mean={d.mean} sigma={d.sigma}"
        )
    if d.low is not None and d.high is not None and d.low > d.high:
        raise ValueError(f"lognormal clip bounds need low <= high, got [{d.low}, {d.high}]")


_CHECKS: dict[str, Callable[[LengthDist], None]] = {
    "fixed": _check_fixed,
    "uniform": _check_uniform,
    "lognormal": _check_lognormal,
}


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a mix; `weight` is relative (normalised over the workload)."""

    name: str
    weight: float
    prompt: LengthDist
    output: LengthDist

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a request class needs a name")
        if not self.weight > 0:
            raise ValueError(f"request class {self.name!r}: weight must be > 0, got {self.weight}")


@dataclass(frozen=True)
class Workload:
    """A named, weighted mix of request classes."""

    name: str
    classes: tuple[RequestClass, ...]
    sessions: int = 0  # > 0: multi-turn conversations (see `multiturn_lengths`)

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if not names:
            raise ValueError(f"workload {self.name!r} has no request classes")
        if len(set(names)) != len(names):
            raise ValueError(f"workload {self.name!r}: class names must be unique, got {names}")

    @classmethod
    def from_lengths(cls, prompt: LengthDist, output: LengthDist, name: str = "custom") -> Workload:
        """A one-class workload, e.g. from ``--prompt-tokens`` and ``--output-tokens``."""
        return cls(name, (RequestClass(name, 1.0, prompt, output),))

    @property
    def probabilities(self) -> np.ndarray:
        weights = np.array([c.weight for c in self.classes], dtype=np.float64)
        return weights / weights.sum()


_CHAT = RequestClass("chat", 1.0, LengthDist.uniform(64, 256), LengthDist.uniform(64, 128))
# 8000 rather than 8192 leaves room for the output inside an 8k context (the bundled model's).
_DOC = RequestClass("doc", 1.0, LengthDist.uniform(2048, 8000), LengthDist.uniform(16, 64))

# Multi-turn conversations: every session opens with the same system prompt; turn t of a
# session resends its whole history (system + t earlier user turns and answers) plus a new user
# turn. Request i is turn i // sessions of session i % sessions, so sessions interleave.
MT_SYSTEM, MT_USER, MT_ANSWER, MT_SESSIONS = 512, 96, 32, 8


def multiturn_lengths(index: int, sessions: int) -> tuple[int, int, int]:
    """(session, turn, prompt tokens) of request `index` of a multi-turn workload."""
    session, turn = index % sessions, index // sessions
    return session, turn, MT_SYSTEM + (turn + 1) * MT_USER + turn * MT_ANSWER


# Named mixes.
NAMED_WORKLOADS: dict[str, Callable[[], Workload]] = {
    "chat": lambda: Workload("chat", (_CHAT,)),
    "docs": lambda: Workload("docs", (_DOC,)),
    # The seeds' interference scenario: steady chat streams, now and then a long document whose
    # prefill stalls co-located decoding. Documents are kept to 2k-4k so a CPU run stays short.
    "mixed": lambda: Workload(
        "mixed",
        (
            RequestClass("chat", 0.9, _CHAT.prompt, _CHAT.output),
            RequestClass("doc", 0.1, LengthDist.uniform(2048, 4096), _DOC.output),
        ),
    ),
    # Shared system prompt, growing histories, sessions interleaved: the KV store's workload.
    "multiturn": lambda: Workload(
        "multiturn",
        (RequestClass("turn", 1.0, LengthDist.fixed(MT_SYSTEM), LengthDist.fixed(MT_ANSWER)),),
        sessions=MT_SESSIONS,
    ),
}


def named_workload(name: str) -> Workload:
    """The workload registered under `name` (see NAMED_WORKLOADS); ValueError lists the names."""
    factory = NAMED_WORKLOADS.get(name)
    if factory is None:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(NAMED_WORKLOADS)}")
    return factory()


ARRIVALS = ("poisson", "gamma")


def arrival_times(kind: str, rate: float, n: int, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """`n` send times in seconds from the start, non-decreasing, the first at 0.

    Gaps are exponential ("poisson") or gamma with shape 1/burstiness ("gamma"), both with mean
    1/rate; burstiness > 1 clusters arrivals, < 1 spaces them evenly. rate=inf sends all at 0.
    """
    if kind not in ARRIVALS:
        raise ValueError(f"unknown arrival process {kind!r}; choose one of {', '.join(ARRIVALS)}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    rng = np.random.default_rng([seed, 0])  # stream 0: arrivals (stream 1: lengths)
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n - 1)
    else:
        gaps = rng.gamma(1.0 / burstiness, burstiness / rate, size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


class RequestSpec(NamedTuple):
    """One request to send: when, which class, how many prompt and output tokens."""

    index: int
    arrival_s: float
    klass: str
    prompt_tokens: int
    output_tokens: int


def generate_requests(
    workload: Workload,
    n: int,
    seed: int,
    arrival: str = "poisson",
    rate: float = math.inf,
    burstiness: float = 1.0,
) -> list[RequestSpec]:
    """`n` requests drawn from `workload`; the same arguments give the identical list.

    Classes and lengths depend only on (workload, n, seed), not on the arrival process or rate.
    """
    times = arrival_times(arrival, rate, n, seed, burstiness)
    rng = np.random.default_rng([seed, 1])
    which = rng.choice(len(workload.classes), size=n, p=workload.probabilities)
    prompt = np.zeros(n, dtype=np.int64)
    output = np.zeros(n, dtype=np.int64)
    for k, klass in enumerate(workload.classes):
        mask = which == k
        count = int(mask.sum())
        prompt[mask] = klass.prompt.sample(rng, count)
        output[mask] = klass.output.sample(rng, count)
    if workload.sessions:
        prompt = np.array([multiturn_lengths(i, workload.sessions)[2] for i in range(n)], np.int64)
    return [
        RequestSpec(i, float(times[i]), workload.classes[which[i]].name, int(p), int(o))
        for i, (p, o) in enumerate(zip(prompt, output, strict=True))
    ]
