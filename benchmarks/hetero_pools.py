"""Heterogeneous pools on this machine, measured vs simulated (issue 39 item 2).

The prefill pool runs dense bf16 weights and the decode pool int4 (each worker its own thread
count), chosen per pool with --prefill-args / --decode-args. `pdserve profile` calibrates each
pool's own configuration (same --threads and --weights as its workers), then `pdserve serve`
runs that mixed deployment under `pdserve bench`, and `pdserve simulate --prefill-gpu
PREFILL.json --decode-gpu DECODE.json` predicts the same requests. The table prints measured
and simulated TTFT/TPOT p50/p90 and their relative error.

    .venv/bin/python benchmarks/hetero_pools.py [--rate 0.5] [--num-requests 30]
        [--prompt-tokens 512] [--output-tokens 32] [--quick] [--out hetero-pools]

The profiles are of the bare engine (no serving overhead: add it with `pdserve profile
--serving-url`, see docs/sim.md), timed while the other pool is idle, so on a busy 2-core
machine the simulation is optimistic by what the serving path and the neighbour add. --quick
profiles are a smoke test: their grid has no long-context decode point (TPOT comes out
35-45 % high); the full grid takes minutes per pool.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from pdserve.bench.compare import ServerProcess, ServerSpec, default_serve_cmd

PDSERVE = [sys.executable, "-m", "pdserve.cli"]
POOLS = {"prefill": "--weights bf16 --threads 1", "decode": "--weights int4 --threads 1"}


def ensure_profile(out: Path, pool: str, quick: bool) -> Path:
    path = out / f"profile-{pool}.json"
    if not path.exists():
        cmd = [*PDSERVE, "profile", *shlex.split(POOLS[pool]), "--out", str(path)]
        subprocess.run(cmd + (["--quick"] if quick else []), check=True)
    return path


def workload(args) -> list[str]:
    return ["--prompt-tokens", str(args.prompt_tokens), "--output-tokens",
            str(args.output_tokens), "--rate", str(args.rate), "--num-requests",
            str(args.num_requests), "--seed", str(args.seed), "--slo-ttft", "5",
            "--slo-tpot", "1"]  # fmt: skip


def measure(args, out: Path) -> dict:
    extra = ("--local-prefill-threshold", "0", "--prefill-args", POOLS["prefill"],
             "--decode-args", POOLS["decode"])  # fmt: skip
    spec = ServerSpec(default_serve_cmd(), "disagg", extra=extra, startup_timeout_s=600)
    with ServerProcess(spec, out / "serve.log") as url:
        cmd = [*PDSERVE, "bench", "--url", url, *workload(args), "--out", str(out / "run"),
               "--no-progress"]  # fmt: skip
        subprocess.run(cmd, check=True)
    return json.loads((out / "run" / "results.json").read_text())["runs"][0]["aggregates"]


def predict(args, profiles: dict[str, Path]) -> dict:
    cmd = [*PDSERVE, "simulate", "--profile", str(profiles["decode"]), "--prefill-gpu",
           str(profiles["prefill"]), "--decode-gpu", str(profiles["decode"]), "--link",
           "loopback", "--mode", "disagg", "--local-prefill-threshold", "0", *workload(args),
           "--json"]  # fmt: skip
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--num-requests", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="profiles on the small grid")
    ap.add_argument("--out", default="hetero-pools")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profiles = {pool: ensure_profile(out, pool, args.quick) for pool in POOLS}
    real = measure(args, out)
    sim = predict(args, profiles)
    print(f"\nprefill pool: {POOLS['prefill']}; decode pool: {POOLS['decode']}; "
          f"{args.num_requests} requests of {args.prompt_tokens}/{args.output_tokens} tokens "
          f"at {args.rate:g}/s")  # fmt: skip
    print(f"{'metric':<6} {'q':<4} {'measured':>10} {'simulated':>10} {'error':>7}")
    for metric in ("ttft_s", "tpot_s"):
        for q in ("p50", "p90"):
            m, p = real[metric][q], sim[metric][q]
            err = f"{(p - m) / m:+.0%}" if m and p is not None else "n/a"
            print(f"{metric[:-2]:<6} {q:<4} {m:>9.3f}s {p:>9.3f}s {err:>7}")
    (out / "table.json").write_text(json.dumps({"measured": real, "simulated": sim}, indent=1))


if __name__ == "__main__":
    main()
