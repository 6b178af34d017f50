"""`pdserve bench compare`: the same workload against each serving mode, one report.

For each mode in turn it starts `pdserve serve --mode ... --host 127.0.0.1 --port P` (or the
`--serve-cmd` given, for other builds or a fake in tests) in its own process group, waits for
GET /health to answer 200, runs the load, and stops the server as Ctrl-C would (SIGINT to the
group, then SIGTERM, then SIGKILL if it lingers). The verdict paragraph ("which to use") is
computed from the measured numbers by `verdict`, never written in advance.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import httpx

from pdserve.bench.runner import RunResult
from pdserve.subprocs import free_port

MODES = ("colocated", "colocated+chunked", "disagg")
READY_POLL_S = 0.25


def mode_args(mode: str, chunk_size: int) -> list[str]:
    """The `serve` arguments that select `mode`."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if mode == "colocated+chunked":
        return ["--mode", "colocated", "--chunk-size", str(chunk_size)]
    return ["--mode", mode]


def default_serve_cmd() -> str:
    return f"{shlex.quote(sys.executable)} -m pdserve.cli serve"


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server: `command` (a shell-style string) + mode args + host/port."""

    command: str
    mode: str
    chunk_size: int = 256
    extra: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0

    def argv(self, port: int) -> list[str]:
        base = shlex.split(self.command) + mode_args(self.mode, self.chunk_size)
        return [*base, *self.extra, "--host", "127.0.0.1", "--port", str(port)]


@dataclass(frozen=True)
class CommandSpec:
    """Any OpenAI-compatible server by its whole command (llama.cpp's llama-server, say):
    host and port are appended; it must answer GET /health with 200 once ready."""

    command: tuple[str, ...]
    startup_timeout_s: float = 300.0

    def argv(self, port: int) -> list[str]:
        return [*self.command, "--host", "127.0.0.1", "--port", str(port)]


class ServerProcess:
    """`with ServerProcess(spec, log_path) as url:` a started, healthy server at `url` (/v1)."""

    def __init__(self, spec: ServerSpec | CommandSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        argv = self.spec.argv(self.port)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_healthy(argv)
        except BaseException:
            self.stop()
            raise
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self, argv: list[str]) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        health = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ValueError(
                    f"`{shlex.join(argv)}` exited with code {self.proc.returncode} before it was "
                    f"ready; its output ends with:\n{self._log_tail()}"
                )
            try:
                if httpx.get(health, timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(READY_POLL_S)
        raise ValueError(
            f"`{shlex.join(argv)}` did not answer GET /health within "
            f"{self.spec.startup_timeout_s:g} s (raise --startup-timeout?); its output ends "
            f"with:\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:]) or "(no output)"

    def stop(self) -> None:
        """Ctrl-C the whole process group; escalate if it does not exit."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)  # the group this class started, nothing else
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def run_modes(
    specs: Sequence[ServerSpec],
    out: Path,
    bench: Callable[[str, str], list[RunResult]],
) -> tuple[dict[str, list[RunResult]], list[str]]:
    """Start each server in turn and call `bench(url, mode)` against it.

    Returns the runs by mode and notes on modes that could not be measured (the comparison
    goes on without them); raises ValueError when no mode could be measured at all.
    """
    results: dict[str, list[RunResult]] = {}
    failures = []
    for spec in specs:
        print(f"== {spec.mode}: starting `{shlex.join(spec.argv(0)[:-4])} ...`", file=sys.stderr)
        try:
            with ServerProcess(spec, out / f"serve-{spec.mode}.log") as url:
                results[spec.mode] = bench(url, spec.mode)
        except ValueError as exc:
            failures.append(f"{spec.mode} was not measured: {exc}")
            print(f"== {spec.mode}: {exc}", file=sys.stderr)
    if not results:
        raise ValueError("no mode could be measured:\n" + "\n".join(failures))
    return results, failures


class ModeNumbers(NamedTuple):
    """What the verdict weighs for one mode."""

    mode: str
    score: float | None  # goodput in req/s for a sweep, else SLO attainment (0..1)
    chat_itl_p99_s: float | None  # p99 ITL of the chat class (all requests if there is none)
    ttft_p99_s: float | None
    itl_scope: str = "chat streams'"  # whose ITL chat_itl_p99_s is, for the text


def mode_numbers(mode: str, runs: Sequence[RunResult], goodput: float | None) -> ModeNumbers:
    """Latencies come from the last (for a sweep: highest-rate, most loaded) run."""
    run = runs[-1]
    chat = run.per_class.get("chat")
    scope = "chat streams'" if chat else "all requests'"
    itl = (chat or run.aggregates)["itl_s"]["p99"]
    score = goodput if len(runs) > 1 else run.aggregates["slo_attainment"]
    return ModeNumbers(mode, score, itl, run.aggregates["ttft_s"]["p99"], scope)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def _rank_key(n: ModeNumbers) -> tuple[float, float, float]:
    inf = float("inf")
    score = -1.0 if n.score is None else n.score
    return (score, -(n.chat_itl_p99_s or inf), -(n.ttft_p99_s or inf))


_ADVICE = {
    "disagg": "Use disaggregated serving for this workload: it {why}, because decoding never "
    "waits behind another request's prefill.",
    "colocated+chunked": "Use co-located serving with chunked prefill: it {why} with one engine "
    "and no KV transfer.",
    "colocated": "Use plain co-located serving: it {why}; at this load neither chunking nor "
    "disaggregation pays for its cost.",
}


def _measured(numbers: Sequence[ModeNumbers], sweep: bool) -> list[str]:
    """The clauses that quote the numbers: score per mode, p99 ITL per mode, their change."""
    if sweep:
        what = "goodput (highest rate with >= 90 % of requests within the SLO)"
        scores = [("none" if n.score is None else f"{n.score:g} req/s") for n in numbers]
    else:
        what = "SLO attainment"
        scores = [("n/a" if n.score is None else f"{100 * n.score:.0f} %") for n in numbers]
    parts = [
        f"Measured here, {what} was "
        + ", ".join(f"{n.mode} {score}" for n, score in zip(numbers, scores, strict=True)),
        f"{numbers[0].itl_scope} p99 inter-token latency was "
        + ", ".join(f"{n.mode} {_ms(n.chat_itl_p99_s)}" for n in numbers),
    ]
    by_mode = {n.mode: n for n in numbers}
    co, dis = by_mode.get("colocated"), by_mode.get("disagg")
    if co and dis and co.chat_itl_p99_s and dis.chat_itl_p99_s:
        change = 1 - dis.chat_itl_p99_s / co.chat_itl_p99_s
        parts.append(
            f"disaggregation {'cut' if change > 0 else 'raised'} it by {abs(100 * change):.0f} % "
            "versus co-located"
        )
    return parts


def verdict(numbers: Sequence[ModeNumbers], sweep: bool) -> str:
    """The "which to use" paragraph, derived only from `numbers`."""
    ranked = sorted(numbers, key=_rank_key, reverse=True)
    best = ranked[0]
    tied = len(ranked) > 1 and ranked[1].score == best.score
    why = (
        "ties on the score and has the lowest p99 inter-token latency"
        if tied
        else f"has the best {'goodput' if sweep else 'SLO attainment'}"
    )
    return "; ".join(_measured(numbers, sweep)) + ". " + _ADVICE[best.mode].format(why=why)
