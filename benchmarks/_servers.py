"""Shared by the serving benchmarks: start `pdserve serve` variants, measure TTFT/ITL, scrape
Prometheus counters."""

from __future__ import annotations

import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.bench.compare import ServerProcess, ServerSpec

SERVE = f"{shlex.quote(sys.executable)} -m pdserve.cli serve"


def server(mode: str, *extra: str, log_dir: Path = Path("/tmp")) -> ServerProcess:
    spec = ServerSpec(SERVE, "disagg" if mode == "disagg" else "colocated", extra=tuple(extra))
    return ServerProcess(spec, log_dir / f"bench-serve-{mode}-{int(time.time())}.log")


def closed_loop(
    url: str, concurrency: int, requests: int, prompt: int, output: int, out_dir: Path, *extra: str
) -> dict:
    """`pdserve bench` at `concurrency` in flight (`prompt`-token prompts, `output` tokens out,
    ignore_eos): the run's aggregates (pdserve.bench.metrics' shape)."""
    load = (
        f"--prompt-tokens {prompt} --output-tokens {output} "
        f"--concurrency {concurrency} --num-requests {requests} --no-progress"
    )
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "--url", url, *load.split(), *extra]
    done = subprocess.run([*cmd, "--out", str(out_dir)], capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"`{shlex.join(cmd)}` failed (exit {done.returncode}):\n{tail}")
    return json.loads((out_dir / "results.json").read_text())["runs"][0]["aggregates"]


def metric(url: str, name: str) -> float:
    """Sum of every sample of a Prometheus metric (e.g. a counter or a histogram's _sum)."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(v) for _, v in pattern.findall(text))


_CLIENT: list[httpx.Client] = []


def _client() -> httpx.Client:
    """One client for every request, as real clients (openai's) keep one: a new httpx client
    costs ~36 ms here (it builds an SSL context), which would be counted in every TTFT."""
    if not _CLIENT:
        _CLIENT.append(httpx.Client(trust_env=False))
    return _CLIENT[0]


def stream_timings(
    url: str, prompt: str | list[int], max_tokens: int, timeout: float = 600
) -> tuple[float, list[float]]:
    """(TTFT, inter-token intervals) of one streaming completion, measured at the client."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    client = _client()
    t0 = time.perf_counter()
    stamps = []
    with client.stream("POST", url + "/completions", json=body, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("no tokens streamed")
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
