"""vs_vllm.py's plan and report: what a run measures; the table, the start-up line and the root
cause of a failed start, from the measured figures and the servers' logs."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path

BUILT = re.compile(r"decode fused \(built in ([\d.]+) s\)")  # pdserve's first start on a machine
VLLM_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
VLLM_COMPILED = "saved AOT compiled function"  # torch.compile ran now (else: from its cache)
VLLM_RECOMPILED = re.compile(r"Compiling model again due to a load failure from \S+, reason: (.*)")
ERROR_LINE = re.compile(r"(?:^|\] )([A-Z]\w*(?:Error|Exception): .*)")


@dataclass
class Plan:
    """What one run measures (from the command line)."""

    servers: list[str]
    concurrency: list[int]
    requests: dict[int, int]
    prompt: int
    output: int
    warmup: int
    cores: str
    vllm_kv_gib: float
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0
    rounds: int = 1  # every server measured this many times, in turns (vs_vllm.py --rounds)

    @property
    def sampling(self) -> tuple[str, ...]:
        """`pdserve bench` arguments for the requests' sampling."""
        return ("--temperature", str(self.temperature), "--top-p", str(self.top_p))


def root_cause(log: Path, most: int = 3) -> str:
    """The first distinct exception messages of a server's log (vLLM's root cause lies far above
    the tail, in a worker's traceback)."""
    if not log.exists():
        return ""
    found: list[str] = []
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        match = ERROR_LINE.search(line)
        if match and match.group(1) not in found:
            found.append(match.group(1))
    lines = "\n".join(f"  {m[:600]}" for m in found[:most])
    return f"\nroot cause in {log}:\n{lines}" if found else f"\nfull log: {log}"


def startup_notes(log: Path) -> dict:
    """The one-time part of a start-up, from the server's log: pdserve's build of the fused
    step; vLLM's engine initialisation, and whether torch.compile ran (vs loaded its cache)."""
    text = log.read_text(encoding="utf-8", errors="replace")
    notes: dict = {}
    if built := BUILT.findall(text):
        notes["build_s"] = sum(map(float, built))
    if init := VLLM_INIT.findall(text):
        notes["engine_init_s"] = float(init[-1])
        notes["compiled_now"] = VLLM_COMPILED in text
        if failed := VLLM_RECOMPILED.findall(text):
            notes["compile_cache_failed"] = failed[-1].strip()
    return notes


def _startup(item: tuple[str, dict]) -> str:
    name, row = item
    if "startup_s" not in row:
        return f"{name} failed"
    note = ""
    if row.get("build_s"):
        note = f" ({row['build_s']:.0f} s of it building the fused step, once per machine)"
    elif "engine_init_s" in row:
        how = "torch.compile ran" if row["compiled_now"] else "compiled graph from its cache"
        if "compile_cache_failed" in row:
            how += f", its cache did not load: {row['compile_cache_failed']}"
        note = f" ({row['engine_init_s']:.0f} s of it engine init: {how})"
    return f"{name} {row['startup_s']:.1f} s{note}"


# a level's figures that are summed over the rounds; the others are their medians
SUMMED = ("requests", "errors", "duration_s")


def combine(rounds: list[dict]) -> dict:
    """One server's rounds (vs_vllm.measure's rows, in the order run; a failed round as
    {"error": why}) as one row: each level's figures the median of the rounds that measured
    it (counts and durations summed), the start-up the median, the rounds kept as measured.
    A server no round measured keeps the first error."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return {**rounds[0], "rounds": rounds}
    levels: dict = {}
    for c in dict.fromkeys(c for r in ok for c in r["levels"]):
        figs = [r["levels"][c] for r in ok if c in r["levels"]]
        levels[c] = {key: _middle(key, [f[key] for f in figs]) for key in figs[0]}
    return {
        **ok[0],
        "startup_s": statistics.median(r["startup_s"] for r in ok),
        "levels": levels,
        "rounds": rounds,
    }


def _middle(key: str, values: list):
    if key in SUMMED:
        return sum(values)
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def round_ratios(row: dict, base: dict, c: int) -> list[float]:
    """tok/s of `row` over `base`'s (vLLM's) at concurrency c, round by round: a pair measured
    minutes apart, which a shared host's drift over a run moves less than the medians."""
    if not row.get("rounds") or not base.get("rounds"):  # one round, or vLLM not run
        return []
    pairs = zip(row["rounds"], base["rounds"], strict=True)
    figs = [(a.get("levels", {}).get(c), b.get("levels", {}).get(c)) for a, b in pairs]
    return [a["tok_s"] / b["tok_s"] for a, b in figs if a and b and b["tok_s"]]


def fmt(value, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _ratio(ours, theirs) -> str:
    return "-" if not ours or not theirs else f"{ours / theirs:.2f}x"


def _rounds(row: dict, base: dict, c: int) -> str:
    return " / ".join(f"{r:.2f}x" for r in round_ratios(row, base, c)) or "-"


def table(results: dict[str, dict], plan: Plan) -> str:
    """One markdown table: every server at every concurrency, ratios against vLLM; with
    several rounds, each figure their median and tok/s's ratio round by round too."""
    vllm = results.get("vllm", {})
    base = vllm.get("levels", {})
    by_round = plan.rounds > 1
    lines = [
        f"{plan.prompt}-token prompts, {plan.output} out (ignore_eos), closed loop, cores "
        f"{plan.cores}; ratios are pdserve/vLLM (tok/s: higher is better; latencies: lower is)"
        + (f"; medians of {plan.rounds} rounds, the servers in turns" if by_round else ""),
        "",
        "| server | concurrency | output tok/s | x vLLM | TTFT p50 | TTFT p90 | TTFT p50 x vLLM "
        "| ITL p50 | ITL p50 x vLLM | requests (errors) |"
        + (" x vLLM by round |" if by_round else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if by_round else ""),
    ]
    for c in plan.concurrency:
        for name, row in results.items():
            fig = row.get("levels", {}).get(c)
            if fig is None:
                continue
            ref = base.get(c, {}) if name != "vllm" else {}
            lines.append(
                f"| {name} | {c} | {fig['tok_s']:.1f} | {_ratio(fig['tok_s'], ref.get('tok_s'))} "
                f"| {fmt(fig['ttft_p50_ms'], '.0f', ' ms')} "
                f"| {fmt(fig['ttft_p90_ms'], '.0f', ' ms')} "
                f"| {_ratio(fig['ttft_p50_ms'], ref.get('ttft_p50_ms'))} "
                f"| {fmt(fig['itl_p50_ms'], '.1f', ' ms')} "
                f"| {_ratio(fig['itl_p50_ms'], ref.get('itl_p50_ms'))} "
                f"| {fig['requests']} ({fig['errors']}) |"
                + (f" {_rounds(row, vllm, c) if name != 'vllm' else '-'} |" if by_round else "")
            )
    lines.append("")
    lines.append("start-up (to GET /health 200): " + ", ".join(map(_startup, results.items())))
    return "\n".join(lines)
