"""Turn parsed `pdserve bench` arguments into runs and reports (the CLI handlers' bodies)."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from pdserve.bench import compare as cmp
from pdserve.bench.client import Endpoint
from pdserve.bench.metrics import SLO
from pdserve.bench.prompts import (
    FilePromptBuilder,
    file_requests,
    load_prompt_builder,
    load_prompt_file,
)
from pdserve.bench.report import write_report
from pdserve.bench.runner import (
    LoadConfig,
    RequestFactory,
    RunResult,
    parse_rates,
    run_load,
    run_sweep,
)
from pdserve.bench.workload import LengthDist, Workload, generate_requests, named_workload

DEFAULT_NUM_REQUESTS = 100


def slo_of(args: argparse.Namespace) -> SLO:
    return SLO(args.slo_ttft, args.slo_tpot, args.slo_itl_p99)


def load_of(args: argparse.Namespace) -> LoadConfig:
    num = args.num_requests
    if num is None and args.duration is None:
        num = DEFAULT_NUM_REQUESTS
    return LoadConfig(
        args.arrival, args.rate, args.burstiness, args.concurrency, num, args.duration, args.seed
    )


def endpoint_of(args: argparse.Namespace, url: str) -> Endpoint:
    return Endpoint(
        url,
        args.model,
        args.api,
        args.timeout,
        not args.no_ignore_eos,
        args.api_key,
        args.extra_body,
        args.temperature,
        args.top_p,
    )


def requests_of(args: argparse.Namespace):
    """(factory, prompt source, description) from --workload / --prompt-tokens / --prompts-file."""
    lengths = args.prompt_tokens or args.output_tokens
    if sum(bool(x) for x in (args.workload, lengths, args.prompts_file)) > 1:
        raise ValueError(
            "choose one of --workload, --prompt-tokens/--output-tokens and "
            "--prompts-file (--output-tokens may go with --prompts-file)"
        )
    if args.prompts_file:
        prompts = load_prompt_file(args.prompts_file)
        output = LengthDist.parse(args.output_tokens or "128")
        factory = functools.partial(file_requests, prompts, output)
        source = FilePromptBuilder(prompts, source="prompt file (lengths from usage)")
        return factory, source, f"{args.prompts_file} ({len(prompts)} prompts, output {output})"
    if lengths:
        workload = Workload.from_lengths(
            LengthDist.parse(args.prompt_tokens or "256"),
            LengthDist.parse(args.output_tokens or "128"),
        )
    else:
        workload = named_workload(args.workload or "chat")
    tokenizer = args.tokenizer or (
        args.model if args.model and Path(args.model).exists() else "bundled"
    )
    source = load_prompt_builder(tokenizer, args.seed)
    classes = "; ".join(
        f"{c.name} x{c.weight:g}: prompt {c.prompt}, output {c.output}" for c in workload.classes
    )
    return functools.partial(generate_requests, workload), source, f"{workload.name} ({classes})"


def _config(args: argparse.Namespace, command: str, description: str, source) -> dict:
    skip = {"func", "command", "bench_action", "api_key"}
    config = {k: v for k, v in vars(args).items() if k not in skip}
    return {
        **config,
        "command_line": command,
        "workload_description": description,
        "prompt_lengths": source.source,
    }


def _notes(command: str, description: str, source, slo: SLO, load: LoadConfig) -> list[str]:
    offered = (
        f"closed loop, {load.concurrency} in flight"
        if load.concurrency
        else f"{load.arrival} arrivals at {load.rate:g} req/s"
    )
    return [
        f"Command: `{command}`",
        "",
        f"* Workload: {description}; prompt lengths: {source.source}",
        f"* Load: {offered}, seed {load.seed}",
        f"* SLO: TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s"
        + (f", per-request p99 ITL <= {slo.itl_p99_s:g} s" if slo.itl_p99_s else ""),
        "* Latencies in ms over ok requests; 'SLO met' counts every request (failures miss).",
    ]


def _measure(args, url: str, factory: RequestFactory, source, label: str = ""):
    """One run, or a sweep when --sweep is given: (runs, goodput). `label` names the runs."""
    endpoint, load, slo = endpoint_of(args, url), load_of(args), slo_of(args)
    progress = not args.no_progress
    if args.sweep:
        result = run_sweep(endpoint, factory, source, load, slo, parse_rates(args.sweep), progress)
        prefix = f"{label} @ " if label else ""
        return [run._replace(label=prefix + run.label) for run in result.runs], result.goodput
    return [run_load(endpoint, factory, source, load, slo, label or "run", progress)], None


def _print(runs: list[RunResult], paths: list[Path], extra: str = "") -> None:
    from pdserve.bench.report import TABLE_HEAD, summary_rows

    print(TABLE_HEAD)
    for run in runs:
        print(summary_rows(run.label, run.aggregates))
    if extra:
        print("\n" + extra)
    print(f"\nwrote {', '.join(str(p) for p in paths)}")


def bench(args: argparse.Namespace, out: Path, command: str) -> int:
    """`pdserve bench`: measure one endpoint; 0 when it ran (failed requests are reported)."""
    from pdserve.bench import timeline

    factory, source, description = requests_of(args)
    slo, load = slo_of(args), load_of(args)
    log_at = timeline.log_offset(args.request_log) if args.request_log else None
    runs, goodput = _measure(args, args.url, factory, source, "")
    notes = _notes(command, description, source, slo, load) + [f"* Endpoint: {args.url}"]
    if args.sweep:
        g = "none of the rates" if goodput is None else f"{goodput:g} req/s"
        notes.append(f"* **Goodput: {g}** (highest rate with >= 90 % of requests within the SLO)")
    config = _config(args, command, description, source)
    rows = []
    if log_at is not None:
        logged = timeline.read_log(args.request_log, log_at)
        rows = timeline.breakdown(logged)
        config["ttft_breakdown"] = rows
        notes += timeline.markdown(rows, len(logged))
    paths = write_report(out, "pdserve bench", config, runs, slo, notes, goodput,
                         sweep=bool(args.sweep))  # fmt: skip
    if rows:
        paths.insert(-1, timeline.plot(out, rows))
    _print(runs, paths, notes[-1] if args.sweep else "")
    return 0


def compare(args: argparse.Namespace, out: Path, command: str) -> int:
    """`pdserve bench compare`: every mode against the same requests, one report."""
    factory, source, description = requests_of(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:  # refuse a bad mode before starting any server
        cmp.mode_args(mode, args.chunk_size)
    specs = [
        cmp.ServerSpec(
            args.serve_cmd or cmp.default_serve_cmd(),
            mode,
            args.chunk_size,
            tuple(args.serve_arg),
            args.startup_timeout,
        )
        for mode in modes
    ]
    out.mkdir(parents=True, exist_ok=True)
    goodputs: dict[str, float | None] = {}

    def bench_mode(url: str, mode: str) -> list[RunResult]:
        runs, goodputs[mode] = _measure(args, url, factory, source, mode)
        return runs

    by_mode, failures = cmp.run_modes(specs, out, bench_mode)
    numbers = [cmp.mode_numbers(m, runs, goodputs[m]) for m, runs in by_mode.items()]
    paragraph = cmp.verdict(numbers, sweep=bool(args.sweep))
    slo, load = slo_of(args), load_of(args)
    notes = _notes(command, description, source, slo, load)
    notes += [f"* Not measured: {f}" for f in failures] + ["", "## Which to use", "", paragraph]
    config = {**_config(args, command, description, source), "verdict": paragraph}
    if args.sweep:
        config["goodput_by_mode"] = {m: goodputs[m] for m in by_mode}
    runs = [run for mode_runs in by_mode.values() for run in mode_runs]
    paths = write_report(out, "pdserve bench compare", config, runs, slo, notes, None)
    _print(runs, paths, paragraph)
    return 0
