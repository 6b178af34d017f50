"""vs_vllm.py's plan and report: what a run measures; the table, the start-up line and the root
cause of a failed start, from the measured figures and the servers' logs."""

from __future__ import annotations

import re
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


def fmt(value, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _ratio(ours, theirs) -> str:
    return "-" if not ours or not theirs else f"{ours / theirs:.2f}x"


def table(results: dict[str, dict], plan: Plan) -> str:
    """One markdown table: every server at every concurrency, ratios against vLLM."""
    base = results.get("vllm", {}).get("levels", {})
    lines = [
        f"{plan.prompt}-token prompts, {plan.output} out (ignore_eos), closed loop, cores "
        f"{plan.cores}; ratios are pdserve/vLLM (tok/s: higher is better; latencies: lower is)",
        "",
        "| server | concurrency | output tok/s | x vLLM | TTFT p50 | TTFT p90 | TTFT p50 x vLLM "
        "| ITL p50 | ITL p50 x vLLM | requests (errors) |",
        "|---|---|---|---|---|---|---|---|---|---|",
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
            )
    lines.append("")
    lines.append("start-up (to GET /health 200): " + ", ".join(map(_startup, results.items())))
    return "\n".join(lines)
