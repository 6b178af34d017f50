"""Write a benchmark's outputs: results.json, PNG plots and summary.md.

results.json::

    {"title": str, "config": {...},              # everything needed to rerun it
     "goodput": float | null,                    # a sweep's goodput (req/s), else null
     "runs": [{"label": str, "load": {...}, "duration_s": float,
               "aggregates": AGG, "per_class": {class: AGG},
               "records": [RequestRecord, ...]}]}   # every request, raw timings

AGG is the dict documented in `pdserve.bench.metrics`. Plots (matplotlib, Agg backend):
ttft_cdf.png and itl_cdf.png (one line per run), and for a sweep attainment_vs_rate.png and
latency_vs_rate.png.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import msgspec

from pdserve.bench.metrics import GOODPUT_ATTAINMENT, SLO
from pdserve.bench.runner import RunResult


def write_results(out: Path, title: str, config: dict, runs: Sequence[RunResult], goodput=None):
    """Write results.json (shape in the module docstring); returns its path."""
    doc = {
        "title": title,
        "config": config,
        "goodput": goodput,
        "runs": [
            {
                "label": run.label,
                "load": dataclasses.asdict(run.load),
                "duration_s": run.duration_s,
                "aggregates": run.aggregates,
                "per_class": run.per_class,
                "records": run.records,
            }
            for run in runs
        ],
    }
    path = out / "results.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=1))
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: Sequence[float], label: str) -> None:
    import numpy as np

    if len(values) == 0:
        return
    xs = np.sort(np.asarray(values) * 1000.0)
    ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=label)


def _cdf_figure(out: Path, name: str, title: str, runs, pick, klass: str | None) -> Path:
    """One CDF figure over ok requests (of `klass` only, if given), one line per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ok = [r for r in run.records if r.ok and klass in (None, r.klass)]
        _cdf(ax, [v for r in ok for v in pick(r) if v is not None], run.label)
    if ax.lines:
        ax.set_xscale("log")
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no ok requests to plot", transform=ax.transAxes, ha="center")
    ax.set(xlabel="milliseconds (log scale)", ylabel="fraction of samples", title=title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return out / name


def plot_cdfs(out: Path, runs: Sequence[RunResult]) -> list[Path]:
    """ttft_cdf.png and itl_cdf.png, one line per run; with several request classes also
    itl_cdf_<class>.png per class (the chat streams' ITL is the interference signal)."""
    ttft, itl = (lambda r: [r.ttft_s]), (lambda r: r.itl_s)
    paths = [
        _cdf_figure(out, "ttft_cdf.png", "Time to first token", runs, ttft, None),
        _cdf_figure(out, "itl_cdf.png", "Inter-token latency (every interval)", runs, itl, None),
    ]
    classes = list(dict.fromkeys(k for run in runs for k in run.per_class))
    for klass in classes if len(classes) > 1 else ():
        title = f"Inter-token latency of {klass} requests"
        paths.append(_cdf_figure(out, f"itl_cdf_{klass}.png", title, runs, itl, klass))
    return paths


def plot_sweep(out: Path, runs: Sequence[RunResult], slo: SLO) -> list[Path]:
    """attainment_vs_rate.png and latency_vs_rate.png for a rate sweep."""
    plt = _pyplot()
    rates = [run.load.rate for run in runs]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(rates, [100 * (r.aggregates["slo_attainment"] or 0) for r in runs], "o-")
    ax.axhline(100 * GOODPUT_ATTAINMENT, color="grey", ls="--", label="goodput threshold")
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105))
    ax.set_title(f"SLO attainment (TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "attainment_vs_rate.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric, target in ((axes[0], "ttft_s", slo.ttft_s), (axes[1], "tpot_s", slo.tpot_s)):
        for pct in ("p50", "p99"):
            ys = [_scaled(r.aggregates[metric][pct]) for r in runs]
            ax.plot(rates, ys, "o-", label=pct)
        ax.axhline(target * 1000, color="grey", ls="--", label="SLO")
        ax.set(xlabel="request rate (req/s)", ylabel="ms", title=metric.removesuffix("_s").upper())
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency_vs_rate.png", dpi=110)
    plt.close(fig)
    return [out / "attainment_vs_rate.png", out / "latency_vs_rate.png"]


def _scaled(seconds: float | None) -> float:
    return float("nan") if seconds is None else seconds * 1000


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds for a table cell; "-" when unmeasured."""
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def summary_rows(label: str, agg: dict) -> str:
    """One Markdown table row for a run (or a class of a run)."""
    s = agg["status"]
    att = agg["slo_attainment"]
    cells = [
        label,
        f"{s['ok']}/{s['error']}/{s['timeout']}",
        f"{agg['request_throughput']:.2f}",
        f"{agg['output_token_throughput']:.1f}",
        *(f"{ms(agg[m]['p50'])} / {ms(agg[m]['p99'])}" for m in ("ttft_s", "tpot_s", "itl_s")),
        f"{ms(agg['e2e_s']['p50'])} / {ms(agg['e2e_s']['p99'])}",
        "-" if att is None else f"{100 * att:.0f} %",
    ]
    return "| " + " | ".join(cells) + " |"


TABLE_HEAD = (
    "| run | ok/error/timeout | req/s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms "
    "| ITL p50/p99 ms | E2E p50/p99 ms | SLO met |\n" + "|---" * 9 + "|"
)


def summary_markdown(title: str, runs: Sequence[RunResult], notes: Sequence[str]) -> str:
    """The Markdown report: notes, a table of runs, then one per-class table per run."""
    lines = [f"# {title}", "", *notes, "", TABLE_HEAD]
    lines += [summary_rows(run.label, run.aggregates) for run in runs]
    if any(len(run.per_class) > 1 for run in runs):
        lines += ["", "## Per request class", "", TABLE_HEAD]
        for run in runs:
            lines += [summary_rows(f"{run.label}: {k}", a) for k, a in run.per_class.items()]
    failures = [r for run in runs for r in run.records if not r.ok]
    if failures:
        lines += ["", "## Failed requests (first 10)", ""]
        lines += [f"* #{r.index} ({r.klass}) {r.status}: {r.error}" for r in failures[:10]]
    return "\n".join(lines) + "\n"


def write_report(
    out: Path,
    title: str,
    config: dict,
    runs: Sequence[RunResult],
    slo: SLO,
    notes: Sequence[str] = (),
    goodput: float | None = None,
    sweep: bool = False,
) -> list[Path]:
    """Write results.json, the plots and summary.md under `out` (created); returns the paths.

    `sweep`: the runs are one load at increasing rates, so rate plots are drawn too.
    """
    out.mkdir(parents=True, exist_ok=True)
    paths = [write_results(out, title, config, runs, goodput), *plot_cdfs(out, runs)]
    if sweep:
        paths += plot_sweep(out, runs, slo)
    (out / "summary.md").write_text(summary_markdown(title, runs, notes), encoding="utf-8")
    return [*paths, out / "summary.md"]
