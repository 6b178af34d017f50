"""The simulator's column of benchmarks/prefill_parallel.py: each variant's TTFT of one request
and prefill throughput as `pdserve simulate` predicts them on this machine.

The calibration, as network_matrix.py calibrates its pools: `pdserve profile --threads 1` of
this machine (made when missing) refitted to the steps a served one-process prefill worker
logged (`pdserve.sim.served.refit_profile`, what `pdserve profile --from-steps` runs): the
"threads" variant's server, over a calibration round of prompts from 32 tokens to the longest
measured (network_matrix's `calibration_round`), sent before its measured requests, so that no
measured step enters a prediction. The decode device keeps the bare profile (a TTFT here holds
no decode step). Each variant is then `pdserve simulate --mode disagg --gpu cpu --link
loopback --chunk 1024` with its own flags (--prefill-pp 2, --prefill-tp 3); a pipeline whose
stages `pdserve serve` pins to shared cores (fewer cores for the worker than stages) is
simulated with --prefill-pp-shared; tensor-parallel ranks that share cores are not modelled
(the simulator gives each rank a device of its own), and the table says so."""

from __future__ import annotations

import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from network_matrix import calibration_round

from pdserve.bench.metrics import SLO
from pdserve.bench.workload import RequestSpec
from pdserve.config import WORKER_CHUNK_SIZE

Window = tuple[float, float]


def ensure_profile(path: Path, model: str | None) -> Path:
    """`path`, made by `pdserve profile --threads 1 --quick` of `model` when missing (a
    worker's one core; its small grid is enough: the served steps refit its efficiencies)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pdserve.cli", "profile", "--threads", "1", "--quick",
               "--out", str(path), *(["--model", model] if model else [])]  # fmt: skip
        subprocess.run(cmd, check=True)
    return path


def calibrate_round(url: str, longest: int) -> Window:
    """Prompts of every length up to `longest` through the server at `url` (/v1), for the
    fit; returns when they ran."""
    start = time.time()
    calibration_round(url.removesuffix("/v1"), longest, random.Random(7))
    return start, time.time()


def refit(profile: Path, steps_dir: Path, window: Window, target: Path) -> Path:
    """`profile` refitted to the prefill worker's steps logged in `steps_dir` within `window`,
    written to `target`."""
    from pdserve.sim.served import refit_profile

    prefill = steps_dir / "prefill"
    prefill.mkdir(exist_ok=True)
    for log in steps_dir.glob("steps-prefill-*.jsonl"):  # `serve --step-log`: every worker's
        log.rename(prefill / log.name)
    shutil.copyfile(profile, target)
    refit_profile(target, prefill, inside=[window])
    return target


def shares_cores(procs: int) -> bool:
    """Whether `pdserve serve --prefill 1 --decode 1` pins a prefill worker of `procs`
    processes (stages or ranks) to shared cores here: the worker gets its share of the cores
    (`ServePlan`), its processes one each only when there are enough (`spawn_ranks`)."""
    from pdserve.launch.local import ServePlan

    cores = sorted(os.sched_getaffinity(0))
    plan = ServePlan.make("disagg", 1, 1, 0, cores, {"prefill": procs, "decode": 1})
    return len(plan.workers[0][1].split(",")) < procs


def processes(variant: tuple[str, ...]) -> int:
    """A prefill worker's processes under a variant's own simulate flags: stages x ranks."""
    sizes = [
        int(variant[i + 1]) for i, f in enumerate(variant) if f in ("--prefill-pp", "--prefill-tp")
    ]
    return math.prod(sizes)


def sim_flags(variant: tuple[str, ...], prefill: Path, decode: Path) -> list[str]:
    """`pdserve simulate` flags of a variant (`variant`: its own, e.g. --prefill-pp 2) on the
    calibrated devices, disaggregated over loopback in the prefill worker's chunks, as served."""
    flags = ["--mode", "disagg", "--gpu", "cpu", "--profile", str(decode), "--prefill-gpu",
             str(prefill), "--link", "loopback", "--chunk", str(WORKER_CHUNK_SIZE["prefill"]),
             *variant]  # fmt: skip
    if "--prefill-pp" in variant and shares_cores(processes(variant)):
        flags.append("--prefill-pp-shared")
    return flags


def predict(flags: list[str], tokens: int, concurrent: int) -> tuple[float, float]:
    """(TTFT of one request alone, prompt tokens/s of `concurrent` arriving at once) as
    `pdserve simulate FLAGS` predicts them: the measurements' shape."""
    from pdserve.cli import build_parser
    from pdserve.sim.commands import cluster_of, deployment_of
    from pdserve.sim.simulator import simulate

    args = build_parser().parse_args(["simulate", *flags, "--rate", "1"])
    cluster, dep, slo = cluster_of(args), deployment_of(args), SLO(args.slo_ttft, args.slo_tpot)
    alone = simulate(cluster, dep, [RequestSpec(0, 0.0, "one", tokens, 2)], slo).records[0]
    burst = [RequestSpec(i, 0.0, "burst", tokens, 1) for i in range(concurrent)]
    ends = [r.start_s + r.e2e_s for r in simulate(cluster, dep, burst, slo).records]
    return alone.ttft_s, concurrent * tokens / max(ends)
