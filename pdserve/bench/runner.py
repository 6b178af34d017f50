"""Drive a load against an endpoint: open loop (arrival times) or closed loop (concurrency).

`run_load` sends the requests and returns every record, one per request that was due within
the run: nothing is dropped, a request that failed is a record with status "error"/"timeout".
`run_sweep` repeats a run at several rates with the same seed (so the same requests, spaced
differently) and reports DistServe's goodput: the highest rate at which >= 90 % of requests meet
the SLO.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import aiohttp

from pdserve.aio import fast_event_loop
from pdserve.bench.client import Endpoint, make_client, send_request
from pdserve.bench.metrics import SLO, RequestRecord, goodput, summarize, summarize_by_class
from pdserve.bench.workload import ARRIVALS, RequestSpec

CLOSED_LOOP_CAP = 100_000  # requests drawn for a closed loop bounded only by --duration


class PromptSource(Protocol):
    exact: bool
    source: str

    def build(self, spec: RequestSpec) -> str: ...


# (n, seed, arrival, rate, burstiness) -> requests; a workload or a prompt file bound in.
RequestFactory = Callable[[int, int, str, float, float], list[RequestSpec]]


@dataclass(frozen=True)
class LoadConfig:
    """How requests are offered. Open loop at `rate` (per second; inf = all at once) unless
    `concurrency` is set (closed loop: that many in flight, the next sent when one ends).
    The run ends after `num_requests`, or when `duration_s` has passed, whichever is first."""

    arrival: str = "poisson"
    rate: float = math.inf
    burstiness: float = 1.0
    concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"unknown arrival process {self.arrival!r}; choose {ARRIVALS}")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("say how long to run: --num-requests N or --duration SECONDS")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration_s}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.duration_s is not None and self.concurrency is None and math.isinf(self.rate):
            raise ValueError("--duration needs a finite --rate (or --concurrency)")

    @property
    def request_count(self) -> int:
        """How many requests to draw; with only a duration, enough to outlast it."""
        if self.num_requests is not None:
            return self.num_requests
        if self.concurrency is not None:
            return CLOSED_LOOP_CAP
        return math.ceil(self.rate * self.duration_s * 2) + 100  # arrivals are cut at duration

    def specs(self, factory: RequestFactory) -> list[RequestSpec]:
        specs = factory(self.request_count, self.seed, self.arrival, self.rate, self.burstiness)
        if self.duration_s is not None and self.concurrency is None:
            specs = [s for s in specs if s.arrival_s < self.duration_s]
        return specs


class RunResult(NamedTuple):
    label: str
    load: LoadConfig
    records: list[RequestRecord]
    duration_s: float
    aggregates: dict
    per_class: dict[str, dict]


async def _check_reachable(client: aiohttp.ClientSession, endpoint: Endpoint) -> None:
    """Fail fast when nothing listens; also warms the connection path (not measured)."""
    url = endpoint.url.rstrip("/") + "/models"
    try:
        async with client.get(url, timeout=aiohttp.ClientTimeout(total=10.0)) as response:
            await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ValueError(
            f"cannot reach {endpoint.url} ({type(exc).__name__}: {exc}); is the server running, "
            "and does --url include the API prefix (e.g. http://127.0.0.1:8000/v1)?"
        ) from None


async def _open_loop(client, endpoint, specs, prompts, t0, on_done) -> list[RequestRecord]:
    tasks = []
    for spec in specs:
        # a loop's timers may fire early (uvloop's by up to a millisecond): sleep until due
        while (delay := t0 + spec.arrival_s - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(send_request(client, endpoint, spec, prompts.build(spec), t0))
        task.add_done_callback(lambda t: on_done(t.result()))
        tasks.append(task)
    return list(await asyncio.gather(*tasks))


async def _closed_loop(client, endpoint, specs, prompts, t0, on_done, load) -> list:
    pending = iter(specs)  # shared by the workers; safe as they all run on this event loop
    records: list[RequestRecord] = []

    async def worker() -> None:
        for spec in pending:
            now = time.perf_counter() - t0
            if load.duration_s is not None and now >= load.duration_s:
                return
            spec = spec._replace(arrival_s=now)  # a closed loop sends as soon as a slot frees
            record = await send_request(client, endpoint, spec, prompts.build(spec), t0)
            records.append(record)
            on_done(record)

    await asyncio.gather(*(worker() for _ in range(load.concurrency)))
    return sorted(records, key=lambda r: r.index)


async def _run(endpoint, specs, prompts, load, on_done) -> tuple[list[RequestRecord], float]:
    async with make_client() as client:
        await _check_reachable(client, endpoint)
        t0 = time.perf_counter()
        if load.concurrency is None:
            records = await _open_loop(client, endpoint, specs, prompts, t0, on_done)
        else:
            records = await _closed_loop(client, endpoint, specs, prompts, t0, on_done, load)
        return records, time.perf_counter() - t0


def run_load(
    endpoint: Endpoint,
    factory: RequestFactory,
    prompts: PromptSource,
    load: LoadConfig,
    slo: SLO,
    label: str = "run",
    progress: bool = True,
) -> RunResult:
    """Run one load to completion (every sent request answered or timed out) and summarize."""
    specs = load.specs(factory)
    total = None if load.concurrency is not None and load.num_requests is None else len(specs)
    bar = _progress_bar(label, total, progress)
    counts = {"ok": 0, "error": 0, "timeout": 0}

    def on_done(record: RequestRecord) -> None:
        counts[record.status] += 1
        bar.set_postfix(counts, refresh=False)
        bar.update()

    try:
        with asyncio.Runner(loop_factory=fast_event_loop()) as runner:
            records, duration = runner.run(_run(endpoint, specs, prompts, load, on_done))
    finally:
        bar.close()
    return RunResult(
        label,
        load,
        records,
        duration,
        summarize(records, slo, duration),
        summarize_by_class(records, slo, duration),
    )


def _progress_bar(label: str, total: int | None, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", disable=not enabled, dynamic_ncols=True)


class SweepResult(NamedTuple):
    runs: list[RunResult]
    goodput: float | None  # requests/s; None when even the lowest rate misses the target


def run_sweep(
    endpoint: Endpoint,
    factory: RequestFactory,
    prompts: PromptSource,
    load: LoadConfig,
    slo: SLO,
    rates: Sequence[float],
    progress: bool = True,
) -> SweepResult:
    """One open-loop run per rate (ascending), same seed; goodput as in metrics.goodput."""
    if load.concurrency is not None:
        raise ValueError("--sweep varies the request rate: drop --concurrency")
    runs = []
    for rate in sorted(rates):
        at_rate = dataclasses.replace(load, rate=rate)
        runs.append(run_load(endpoint, factory, prompts, at_rate, slo, f"{rate:g} req/s", progress))
    attained = {run.load.rate: run.aggregates["slo_attainment"] for run in runs}
    return SweepResult(runs, goodput(attained))


def parse_rates(text: str) -> list[float]:
    """ "0.5,1,2" -> [0.5, 1.0, 2.0]; ValueError on anything but positive finite numbers."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        rates = []
    if not rates or not all(r > 0 and not math.isinf(r) for r in rates):
        raise ValueError(f"--sweep takes positive request rates like 0.5,1,2,4, got {text!r}")
    return rates
