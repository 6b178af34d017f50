"""The seeds' decision matrix, measured on network hosts: the same workload served disaggregated
(router, prefill worker, decode worker each on a host of its own, the KV crossing the prefill
host's link) and co-located (one `both` worker on its own host, the same cores), while the
prefill host's link is shaped (tc tbf) to each rate; TTFT of the measured prompts and ITL of
the streams running beside them, p50/p99, and the crossover bandwidth: the link rate under
which the disaggregated TTFT p50 exceeds the co-located one (log-interpolated between rates).
Where `pdserve simulate` can be calibrated (a `pdserve profile` of this machine, --profile), its
prediction for the same link and lengths is printed beside each cell.

    .venv/bin/python benchmarks/network_matrix.py                 # ~5 min on 2 cores
    .venv/bin/python benchmarks/network_matrix.py --rates 1000,200,50 --lengths 512,2048 \\
        --requests 3 --profile profile-1t.json --json out.json

Load per cell: two background streams (short prompts, long outputs) decode throughout; the
measured prompts (random token ids, so no prefix cache answers) arrive one after the other,
each generating 16 tokens. Co-located, each long prefill pauses the streams (their ITL p99);
disaggregated, the streams are undisturbed but each prompt's KV crosses the link first (its
TTFT). Needs root and iproute2 (bench/netns.py); the link rate 0 means unshaped (a veth pair:
a few Gbit/s of this machine's CPU). --delay-ms and --loss-pct add a one-way delay and a loss
rate to the prefill link in every disaggregated cell (bench/wire.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from servers import Command  # noqa: E402

from pdserve.bench import netns  # noqa: E402

ENGINE = ["--threads", "1", "--kv-cache-gb", "0.5", "--max-model-len", "4096"]
OUTPUT_TOKENS, STREAM_TOKENS, BACKGROUND = 16, 100_000, 2


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def stream(url: str, prompt: list[int], max_tokens: int, stop: threading.Event | None = None):
    """One greedy stream: (ttft_s, [itl_s...]); stops early when `stop` is set."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if '"error"' in line:
                    raise RuntimeError(line)
                times.append(time.perf_counter())
                if stop is not None and stop.is_set():
                    break
    if not times:
        raise RuntimeError("no token")
    return times[0] - t0, [b - a for a, b in itertools.pairwise(times)]


class Deployment:
    """One router on `router_host` at `port` with its workers, each on a host of its own."""

    def __init__(self, net, mode: str, port: int, workers: dict[str, list[str]], env: dict):
        router_host = net.hosts["router"]
        self.url = f"http://{router_host.address}:{port}"
        control = f"tcp://{router_host.address}:{port - 1000}"
        self.procs = [
            Command(
                "router",
                "--host",
                router_host.address,
                "--port",
                str(port),
                "--control-host",
                router_host.address,
                "--control-port",
                str(port - 1000),
                "--mode",
                mode,
                "--local-prefill-threshold",
                "0",
                ready="router on",
                env=env,
                prefix=router_host.prefix(),
            )  # fmt: skip
        ]
        for host, argv in workers.items():
            self.procs.append(
                Command("worker", *argv, "--router", control, *ENGINE, ready=r"\) ready",
                        env=env, prefix=net.hosts[host].prefix(), startup_timeout_s=600)
            )  # fmt: skip
        client = net.hosts["client"]
        deadline = time.monotonic() + 120
        while client.call(httpx.get, self.url + "/health", timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: workers never registered")
            time.sleep(0.5)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def cell(client, url: str, length: int, requests: int, rng: random.Random) -> dict:
    """Measured prompts of `length` tokens one after another beside BACKGROUND streams."""

    def run():
        stop = threading.Event()
        itls: list[float] = []

        def background(i):
            _, gaps = stream(url, [rng.randrange(1000, 40000) for _ in range(8)], STREAM_TOKENS,
                             stop)  # fmt: skip
            itls.extend(gaps[2:])

        streams = [threading.Thread(target=background, args=(i,)) for i in range(BACKGROUND)]
        for t in streams:
            t.start()
        time.sleep(2.0)  # the streams are decoding
        ttfts = []
        for _ in range(requests):
            prompt = [rng.randrange(1000, 40000) for _ in range(length)]
            ttfts.append(stream(url, prompt, OUTPUT_TOKENS)[0])
        stop.set()
        for t in streams:
            t.join()
        return ttfts, itls

    ttfts, itls = client.call(run)
    return {"ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99),
            "itl_p50": pct(itls, 0.5), "itl_p99": pct(itls, 0.99), "ttfts": ttfts}  # fmt: skip


def predict(profile: str, mode: str, length: int, gbps: float | None, requests: int) -> float:
    """`pdserve simulate`'s TTFT p50 for these prompts at a low rate (one at a time, without
    the background streams: the link and the prefill are what it predicts)."""
    cmd = [sys.executable, "-m", "pdserve.cli", "simulate", "--gpu", "cpu", "--profile", profile,
           "--mode", mode, "--prompt-tokens", f"fixed:{length}",
           "--output-tokens", f"fixed:{OUTPUT_TOKENS}", "--rate", "0.05",
           "--num-requests", str(max(requests, 20)), "--json"]  # fmt: skip
    if mode == "disagg":
        cmd += ["--bandwidth-gbps", str(gbps)] if gbps else ["--link", "loopback"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode:
        return float("nan")
    return json.loads(done.stdout[done.stdout.index("{") :])["ttft_s"]["p50"]


def crossover(rates: list[float], disagg: list[float], colocated: float) -> str:
    """The link rate (Mbit/s) where the disagg TTFT p50 crosses the co-located one."""
    points = sorted(zip(rates, disagg, strict=True), reverse=True)  # fastest first
    if points[-1][1] <= colocated:
        return f"none: within co-located down to {points[-1][0]:g} Mbit/s"
    if points[0][1] > colocated:
        return f"none: above co-located at every rate (from {points[0][0]:g} Mbit/s down)"
    for (r1, t1), (r2, t2) in itertools.pairwise(points):
        if t1 <= colocated < t2:
            f = (colocated - t1) / (t2 - t1)
            rate = math.exp(math.log(r1) + f * (math.log(r2) - math.log(r1)))
            return f"{rate:.0f} Mbit/s (above it within co-located)"
    return "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="0,1000,200,50",
                        help="prefill link rates, Mbit/s (0: unshaped)")  # fmt: skip
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--requests", type=int, default=3, help="measured prompts per cell")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="one-way delay on the prefill link, each way")  # fmt: skip
    parser.add_argument("--loss-pct", type=float, default=0.0,
                        help="frames dropped on the prefill link, each way")  # fmt: skip
    parser.add_argument("--profile", help="`pdserve profile` JSON: print simulate's prediction")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument(
        "--results", help="print the table of an earlier --json run, measure nothing"
    )
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.results:
        saved = json.loads(Path(args.results).read_text())
        results = {
            "colocated": {int(n): c for n, c in saved["colocated"].items()},
            "disagg": {int(n): {float(r): c for r, c in by.items()}
                       for n, by in saved["disagg"].items()},
        }  # fmt: skip
    else:
        if why := netns.unavailable():
            print(f"network_matrix: cannot make hosts: {why}")
            return 2
        results = measure(rates, lengths, args.requests, args.delay_ms, args.loss_pct)
    table(results, rates, lengths, args.profile, args.requests)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


def measure(
    rates: list[float], lengths: list[int], requests: int, delay_ms: float, loss_pct: float
) -> dict:
    env = {"PDSERVE_SECRET": secrets.token_hex(16)}
    rng = random.Random(0)
    results: dict = {"colocated": {}, "disagg": {}}
    with netns.Network() as net:
        for name in ("router", "prefill", "decode", "colo", "client"):
            net.add_host(name)
        client = net.hosts["client"]
        deps = []
        try:
            deps.append(colo := Deployment(net, "colocated", 8001,
                                           {"colo": ["--role", "both"]}, env))  # fmt: skip
            deps.append(disagg := Deployment(net, "disagg", 8000, {
                "prefill": ["--role", "prefill", "--transfer-timeout-s", "600"],
                "decode": ["--role", "decode", "--kv-host", net.hosts["decode"].address],
            }, env))  # fmt: skip
            for n in lengths:
                results["colocated"][n] = cell(client, colo.url, n, requests, rng)
                print(f"colocated {n}: {results['colocated'][n]}", flush=True)
                for rate in rates:
                    prefill = net.hosts["prefill"]
                    if rate or delay_ms or loss_pct:
                        prefill.shape(rate * 1e6 or None, delay_ms=delay_ms, loss_pct=loss_pct)
                    sent = prefill.bytes_sent()
                    try:
                        got = cell(client, disagg.url, n, requests, rng)
                    finally:
                        prefill.unshape()
                    got["link_mbytes"] = (prefill.bytes_sent() - sent) / 1e6
                    results["disagg"].setdefault(n, {})[rate] = got
                    print(f"disagg {n} @ {rate:g} Mbit/s: {got}", flush=True)
        finally:
            for dep in deps:
                dep.stop()
    return results


def table(results: dict, rates, lengths, profile, requests) -> None:
    print()
    header = ("prompt", "link", "mode", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "sim TTFT")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for n in lengths:
        c = results["colocated"][n]
        sim = predict(profile, "colocated", n, None, requests) if profile else None
        row = [n, "-", "colocated", c["ttft_p50"], c["ttft_p99"], c["itl_p50"], c["itl_p99"], sim]
        print(_row(row))
        for rate in rates:
            d = results["disagg"][n][rate]
            gbps = rate / 1000 if rate else None
            sim = predict(profile, "disagg", n, gbps, requests) if profile else None
            label = f"{rate:g} Mbit/s" if rate else "unshaped"
            print(_row([n, label, "disagg", d["ttft_p50"], d["ttft_p99"], d["itl_p50"],
                        d["itl_p99"], sim]))  # fmt: skip
        shaped = [r for r in rates if r]
        cross = crossover(shaped, [results["disagg"][n][r]["ttft_p50"] for r in shaped],
                          c["ttft_p50"])  # fmt: skip
        results.setdefault("crossover", {})[n] = cross
        print(f"\nprompt {n}: crossover of TTFT p50 (disaggregated vs co-located): {cross}\n")


def _row(cells) -> str:
    def fmt(v):
        if isinstance(v, float):
            return "-" if math.isnan(v) else f"{v * 1000:.0f} ms"
        return "-" if v is None else str(v)

    return "| " + " | ".join(fmt(v) for v in cells) + " |"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
