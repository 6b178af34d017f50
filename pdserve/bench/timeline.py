"""The TTFT breakdown of a pdserve server's requests, from its `--request-log` lines
(`router/request_log.py`): at each TTFT percentile, how much of it was queue, decode wait
(the decode worker finding blocks for a remote prefill), prefill and the KV transfer's exposed
part; `pdserve bench --request-log FILE` puts the table in summary.md and draws
ttft_breakdown.png (stacked bars)."""

from __future__ import annotations

import json
from pathlib import Path

# the bench's components: the request log's phases each belongs to
COMPONENTS = {
    "queue": ("queue", "prefill_queue"),
    "decode_wait": ("decode_wait",),
    "prefill": ("prefill", "local_prefill"),
    "transfer": ("transfer",),
}
PERCENTILES = (50, 90, 99)
BAND = 5  # a percentile's row averages the requests within +-BAND percentiles of it


def log_offset(path: str | Path) -> int:
    """Where the log ends now (lines appended after it are a run's)."""
    p = Path(path)
    return p.stat().st_size if p.exists() else 0


def read_log(path: str | Path, offset: int = 0) -> list[dict]:
    """The request log's records from byte `offset` on (a line cut short is left out)."""
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def components(rec: dict) -> dict[str, float]:
    """Seconds of each component of one record's TTFT."""
    spans = {name: end - start for name, start, end in rec["phases"]}
    return {c: sum(spans.get(p, 0.0) for p in phases) for c, phases in COMPONENTS.items()}


def breakdown(records: list[dict], percentiles=PERCENTILES) -> list[dict]:
    """Per percentile of TTFT (ok requests with a first token): the TTFT there and its mean
    components over the requests within BAND percentiles of it, with how many they were."""
    ok = sorted(
        (r for r in records if r.get("status") == "ok" and r.get("ttft_s") is not None),
        key=lambda r: r["ttft_s"],
    )
    if not ok:
        return []
    rows = []
    n = len(ok)
    for p in percentiles:
        lo = min(n - 1, int(n * max(0, p - BAND) / 100))
        hi = max(lo + 1, min(n, int(-(-n * min(100, p + BAND) // 100))))
        band = ok[lo:hi]
        at = ok[min(n - 1, int(n * p / 100))]
        parts = [components(r) for r in band]
        row = {"percentile": p, "ttft_s": at["ttft_s"], "requests": len(band)}
        row |= {c: sum(x[c] for x in parts) / len(parts) for c in COMPONENTS}
        rows.append(row)
    return rows


def markdown(rows: list[dict], n_records: int) -> list[str]:
    """The breakdown as a Markdown section (empty without rows)."""
    if not rows:
        return []
    head = "| TTFT pct | TTFT ms | " + " | ".join(f"{c} ms" for c in COMPONENTS) + " | requests |"
    lines = [
        "",
        "## TTFT breakdown (from the server's --request-log)",
        "",
        f"{n_records} requests logged. Each row: the TTFT at that percentile and the mean of "
        f"each component over the requests within +-{BAND} percentiles of it (queue: fair turn "
        "+ prefill queue; decode_wait: the decode worker finding blocks; prefill: forward "
        "passes, on the prefill or decode worker; transfer: the KV push after the last layer).",
        "",
        head,
        "|" + "---|" * (len(COMPONENTS) + 3),
    ]
    for r in rows:
        cells = " | ".join(f"{r[c] * 1000:.1f}" for c in COMPONENTS)
        lines.append(
            f"| p{r['percentile']} | {r['ttft_s'] * 1000:.1f} | {cells} | {r['requests']} |"
        )
    return lines


def plot(out: Path, rows: list[dict]) -> Path | None:
    """ttft_breakdown.png: one stacked bar per percentile."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"p{r['percentile']}" for r in rows]
    bottom = [0.0] * len(rows)
    for c in COMPONENTS:
        heights = [r[c] * 1000 for r in rows]
        ax.bar(labels, heights, bottom=bottom, label=c)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.scatter(labels, [r["ttft_s"] * 1000 for r in rows], color="black", zorder=3, label="TTFT")
    ax.set_ylabel("ms")
    ax.set_title("TTFT breakdown (router's request log)")
    ax.legend(fontsize="small")
    path = out / "ttft_breakdown.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
