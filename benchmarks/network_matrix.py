"""The seeds' decision matrix, measured on network hosts: the same workload served disaggregated
(router, prefill worker, decode worker each on a host of its own, the KV crossing the prefill
host's link) and co-located (one `both` worker on its own host, the same cores), while the
prefill host's link is shaped (tc tbf) to each rate; TTFT of the measured prompts and ITL of
the streams running beside them, p50/p99, and the crossover bandwidth: the link rate under
which the disaggregated TTFT p50 exceeds --ttft-slack times the co-located one (the TTFT
disaggregation may give for removing the co-located ITL stalls; log-interpolated between
rates). With --profile (`pdserve profile --threads 1` of this machine), each worker's logged
steps refit it per pool (the compute speed the processes had beside each other on these
cores), and `pdserve simulate` predicts every cell and the crossover (on a fine grid of rates)
beside the measured ones: the link model is what that tests.

    .venv/bin/python benchmarks/network_matrix.py                 # ~5 min on 2 cores
    .venv/bin/python benchmarks/network_matrix.py --rates 1000,200,100,50,25 \\
        --lengths 512,2048 --requests 3 --profile profile-1t.json --json out.json

Load per cell: two background streams (short prompts, long outputs) decode throughout; the
measured prompts (random token ids, so no prefix cache answers) arrive one after the other,
each generating 16 tokens. Co-located, each long prefill pauses the streams (their ITL p99);
disaggregated, the streams are undisturbed but each prompt's KV crosses the link first (its
TTFT). Needs root and iproute2 (bench/netns.py); the link rate 0 means unshaped (a veth pair:
a few Gbit/s of this machine's CPU). --delay-ms and --loss-pct add a one-way delay and a loss
rate to the prefill link in every disaggregated cell (bench/wire.py); --prefill-args gives the
prefill worker more flags: `--kv-push whole` (the whole cache once the prompt is computed,
against layer-wise streaming) or `--kv-compression fp8` (half the bytes on the wire).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from servers import Command  # noqa: E402

from pdserve import envs  # noqa: E402
from pdserve.bench import netns  # noqa: E402
from pdserve.config import WORKER_CHUNK_SIZE  # noqa: E402


def engine_flags(longest: int) -> list[str]:
    """One thread per worker; room for the longest prompt and, on the decode worker, the
    background streams growing to the same length."""
    max_len = max(4096, longest + OUTPUT_TOKENS + 64)
    gb = 0.5 * math.ceil(max_len / 4096)
    return ["--threads", "1", "--kv-cache-gb", f"{gb:g}", "--max-model-len", str(max_len)]


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

    def __init__(
        self, net, mode: str, port: int, workers: dict[str, list[str]], env: dict, steps: Path,
        engine: list[str],
    ):  # fmt: skip
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
                Command("worker", *argv, "--router", control, *engine, ready=r"\) ready",
                        env={**env, envs.STEP_LOG: str(steps / host)},
                        prefix=net.hosts[host].prefix(), startup_timeout_s=600)
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


CALIBRATION_PROMPTS = 20


def calibration_round(url: str, longest: int, rng: random.Random) -> None:
    """Prompts from 32 tokens to `longest`, log-spaced, one after the other: logged steps of
    every shape for `calibrate` (a prefill worker logs one or two per prompt)."""
    for i in range(CALIBRATION_PROMPTS):
        n = round(32 * (longest / 32) ** (i / (CALIBRATION_PROMPTS - 1)))
        stream(url, [rng.randrange(1000, 40000) for _ in range(n)], 4)


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


def calibrate(profile: str, steps: Path, out: Path) -> dict[str, str]:
    """Per pool (co-located worker, prefill worker, decode worker), `profile` refitted to the
    steps that worker logged while it served this run (`pdserve profile --from-steps`): the
    compute speed the processes had beside each other on these cores. The link is what the
    prediction then tests."""
    from pdserve.sim.served import refit_profile

    out.mkdir(parents=True, exist_ok=True)
    fitted = {}
    for pool in ("colo", "prefill", "decode"):
        target = out / f"profile-{pool}.json"
        shutil.copyfile(profile, target)
        try:
            refit_profile(target, steps / pool)
        except ValueError as exc:
            raise RuntimeError(f"calibrating {pool} from {steps / pool}: {exc}") from None
        fitted[pool] = str(target)
    return fitted


def predict(profiles: dict[str, str], length: int, mbit: float | None) -> float:
    """`pdserve simulate`'s TTFT p50 for these prompts arriving far apart (one at a time, as
    measured; the background streams are not simulated), prefilled in the workers' chunks:
    co-located (mbit None) or disaggregated over a link of `mbit` Mbit/s (0: loopback)."""
    cmd = [sys.executable, "-m", "pdserve.cli", "simulate", "--gpu", "cpu",
           "--prompt-tokens", f"fixed:{length}", "--output-tokens", f"fixed:{OUTPUT_TOKENS}",
           "--rate", "0.002", "--chunk", str(WORKER_CHUNK_SIZE["both"]),
           "--num-requests", "20", "--json"]  # fmt: skip
    if mbit is None:
        cmd += ["--mode", "colocated", "--profile", profiles["colo"]]
    else:
        cmd += ["--mode", "disagg", "--profile", profiles["decode"],
                "--prefill-gpu", profiles["prefill"]]  # fmt: skip
        cmd += ["--bandwidth-gbps", str(mbit / 1000)] if mbit else ["--link", "loopback"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr[-500:]}")
    return json.loads(done.stdout[done.stdout.index("{") :])["ttft_s"]["p50"]


def crossover(points: list[tuple[float, float]], limit: float) -> float | None:
    """The link rate (Mbit/s) below which the disaggregated TTFT p50 exceeds `limit`,
    log-interpolated between the (rate, TTFT) points; None when no two points straddle it."""
    points = sorted(points, reverse=True)  # fastest first
    for (r1, t1), (r2, t2) in itertools.pairwise(points):
        if t1 <= limit < t2:
            f = (limit - t1) / (t2 - t1)
            return math.exp(math.log(r1) + f * (math.log(r2) - math.log(r1)))
    return None


SIM_RATES = [10 * 10 ** (i / 8) for i in range(25)]  # 10 Mbit/s to 10 Gbit/s, 8 per decade


def table(results: dict, rates, lengths, profiles: dict | None, slack: float) -> None:
    """Measured (and predicted, with `profiles`) per cell; the crossover per prompt length:
    where the disaggregated TTFT p50 passes `slack` x the co-located one, the TTFT
    disaggregation may give for the decode stalls it removes (co-located ITL p99)."""
    print()
    header = ("prompt", "link", "mode", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
              "sim TTFT", "sim err")  # fmt: skip
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    sim = results.setdefault("predicted", {})
    for n in lengths:
        c = results["colocated"][n]
        cells = [(None, "-", "colocated", c)]
        cells += [(r, f"{r:g} Mbit/s" if r else "unshaped", "disagg", results["disagg"][n][r])
                  for r in rates]  # fmt: skip
        for rate, label, mode, got in cells:
            key = f"{n}/{mode}/{rate}"
            if profiles and key not in sim:
                sim[key] = predict(profiles, n, rate)
            p = sim.get(key)
            err = f"{(p - got['ttft_p50']) / got['ttft_p50']:+.0%}" if p else "-"
            print(_row([n, label, mode, got["ttft_p50"], got["ttft_p99"], got["itl_p50"],
                        got["itl_p99"], p, err]))  # fmt: skip
        limit = slack * c["ttft_p50"]
        measured = crossover([(r, results["disagg"][n][r]["ttft_p50"]) for r in rates if r],
                             limit)  # fmt: skip
        line = f"\nprompt {n}: disaggregated TTFT p50 passes {slack:g} x co-located's " \
               f"({limit:.2f} s) below {_mbit(measured, rates)}"  # fmt: skip
        if profiles:
            sim_limit = slack * sim[f"{n}/colocated/None"]
            curve = [(r, sim.setdefault(f"{n}/disagg/{r:.4g}", predict(profiles, n, r)))
                     for r in SIM_RATES]  # fmt: skip
            predicted = crossover(curve, sim_limit)
            line += f"; predicted below {_mbit(predicted, SIM_RATES)}"
            if measured and predicted:
                line += f" (x{max(measured, predicted) / min(measured, predicted):.2f} apart)"
            results.setdefault("crossover", {})[n] = {"measured": measured, "predicted": predicted}
        print(line + "\n")


def _mbit(rate: float | None, rates: list[float]) -> str:
    if rate is not None:
        return f"{rate:.0f} Mbit/s"
    return f"none between {max(rates):g} and {min(r for r in rates if r):g} Mbit/s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="0,1000,200,50",
                        help="prefill link rates, Mbit/s (0: unshaped)")  # fmt: skip
    parser.add_argument("--lengths", default="512,2048",
                        help="prompt tokens (the bundled model's context is 8,192: 8000 is "
                        "the longest that leaves room for the output)")  # fmt: skip
    parser.add_argument("--requests", type=int, default=3, help="measured prompts per cell")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="one-way delay on the prefill link, each way")  # fmt: skip
    parser.add_argument("--loss-pct", type=float, default=0.0,
                        help="frames dropped on the prefill link, each way")  # fmt: skip
    parser.add_argument("--prefill-args", default="",
                        help="more flags for the disaggregated prefill worker, e.g. "
                        "'--kv-push whole' or '--kv-compression fp8'")  # fmt: skip
    parser.add_argument("--profile", help="`pdserve profile --threads 1` JSON of this machine: "
                        "refitted to the workers' logged steps, it predicts each cell")  # fmt: skip
    parser.add_argument("--ttft-slack", type=float, default=1.5,
                        help="the crossover: where disaggregated TTFT p50 passes this many "
                        "times the co-located one (default 1.5)")  # fmt: skip
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--plot", help="draw TTFT against the link rate into this PNG")
    parser.add_argument(
        "--results", help="print the table (and --plot) of an earlier --json run, measure nothing"
    )
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    work = Path(args.json).with_suffix("") if args.json else Path(tempfile.mkdtemp())
    if args.results:
        saved = json.loads(Path(args.results).read_text())
        results = {
            "colocated": {int(n): c for n, c in saved["colocated"].items()},
            "disagg": {int(n): {float(r): c for r, c in by.items()}
                       for n, by in saved["disagg"].items()},
            "predicted": saved.get("predicted", {}),
        }  # fmt: skip
        profiles = saved.get("profiles")
        lengths = sorted(results["colocated"])
        rates = sorted(results["disagg"][lengths[0]], key=lambda r: (r != 0, -r))
    else:
        if why := netns.unavailable():
            print(f"network_matrix: cannot make hosts: {why}")
            return 2
        shaping = (args.delay_ms, args.loss_pct)
        results = measure(rates, lengths, args.requests, shaping, work / "steps",
                          args.prefill_args.split())  # fmt: skip
        profiles = calibrate(args.profile, work / "steps", work) if args.profile else None
        results["profiles"] = profiles
    table(results, rates, lengths, profiles, args.ttft_slack)
    if args.plot:
        plot(results, rates, lengths, args.ttft_slack, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


def measure(
    rates: list[float], lengths: list[int], requests: int, shaping: tuple, steps: Path,
    prefill_args: list[str],
) -> dict:  # fmt: skip
    delay_ms, loss_pct = shaping
    env = {"PDSERVE_SECRET": secrets.token_hex(16)}
    engine = engine_flags(max(lengths))
    rng = random.Random(0)
    results: dict = {"colocated": {}, "disagg": {}}
    with netns.Network() as net:
        for name in ("router", "prefill", "decode", "colo", "client"):
            net.add_host(name)
        client = net.hosts["client"]
        deps = []
        try:
            colo_workers = {"colo": ["--role", "both"]}
            deps.append(colo := Deployment(net, "colocated", 8001, colo_workers, env, steps,
                                           engine))  # fmt: skip
            deps.append(disagg := Deployment(net, "disagg", 8000, {
                "prefill": ["--role", "prefill", "--transfer-timeout-s", "600", *prefill_args],
                "decode": ["--role", "decode", "--kv-host", net.hosts["decode"].address],
            }, env, steps, engine))  # fmt: skip
            for dep in deps:  # steps of every prompt length, for the calibration
                client.call(calibration_round, dep.url, max(lengths), rng)
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


def plot(results: dict, rates, lengths, slack: float, path: str) -> None:
    """TTFT p50 against the link rate, per prompt length: measured disaggregated (points),
    predicted (line), co-located measured and predicted (horizontal), and the crossover limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
    sim = results.get("predicted", {})
    for ax, n in zip(axes[0], lengths, strict=True):
        shaped = sorted(r for r in rates if r)
        ax.plot(shaped, [results["disagg"][n][r]["ttft_p50"] for r in shaped], "o",
                color="C0", label="disaggregated, measured")  # fmt: skip
        curve = [(r, sim[f"{n}/disagg/{r:.4g}"]) for r in SIM_RATES if f"{n}/disagg/{r:.4g}" in sim]
        if curve:
            ax.plot(*zip(*curve, strict=True), "-", color="C0", label="disaggregated, simulated")
        colo = results["colocated"][n]["ttft_p50"]
        ax.axhline(colo, color="C1", label="co-located, measured")
        if (p := sim.get(f"{n}/colocated/None")) is not None:
            ax.axhline(p, color="C1", linestyle="--", label="co-located, simulated")
        ax.axhline(slack * colo, color="grey", linestyle=":", label=f"{slack:g} x co-located")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("prefill -> decode link, Mbit/s")
        ax.set_ylabel("TTFT p50, s")
        ax.set_title(f"{n}-token prompts")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def _row(cells) -> str:
    def fmt(v):
        if isinstance(v, float):
            return "-" if math.isnan(v) else f"{v * 1000:.0f} ms"
        return "-" if v is None else str(v)

    return "| " + " | ".join(fmt(v) for v in cells) + " |"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
