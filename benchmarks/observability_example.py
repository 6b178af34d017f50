"""The pictures of docs/observability.md from a real run: a disaggregated `pdserve serve` with
tracing (to an OTLP/HTTP receiver in this script) and a request log; `pdserve bench` against
it with --request-log (its TTFT breakdown: ttft_breakdown.png); then one request's trace drawn
as a timeline of its spans per process (trace_timeline.png) and printed as a table.

    .venv/bin/python benchmarks/observability_example.py [--out docs/results/observability]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _otlp import Receiver  # noqa: E402
from _servers import server  # noqa: E402


def draw(spans, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(s.start_time_unix_nano for _, s in spans)
    rows = sorted(spans, key=lambda x: x[1].start_time_unix_nano)
    colors = {"pdserve-router": "tab:blue", "pdserve-prefill": "tab:orange",
              "pdserve-decode": "tab:green"}  # fmt: skip
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1))
    for i, (svc, s) in enumerate(rows):
        start = (s.start_time_unix_nano - t0) / 1e6
        width = max((s.end_time_unix_nano - s.start_time_unix_nano) / 1e6, 0.2)
        ax.barh(i, width, left=start, color=colors.get(svc, "grey"))
        ax.text(start + width, i, f" {width:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{svc.removeprefix('pdserve-')}: {s.name}"
                                     for svc, s in rows])  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlabel("ms since the request arrived")
    ax.set_title("one disaggregated request's trace (spans from three processes)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/observability")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec = Receiver()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "requests.jsonl"
        flags = ("--local-prefill-threshold", "0", "--otlp-traces-endpoint", rec.url,
                 "--request-log", str(log))  # fmt: skip
        with server("disagg", *flags) as url:
            bench = [sys.executable, "-m", "pdserve.cli", "bench", "--url", url,
                     "--prompt-tokens", "uniform:128,1024", "--output-tokens", "32",
                     "--concurrency", "4", "--num-requests", "24", "--no-progress",
                     "--request-log", str(log), "--out", str(Path(tmp) / "bench")]  # fmt: skip
            subprocess.run(bench, check=True, capture_output=True)
            shutil.copy(Path(tmp) / "bench" / "ttft_breakdown.png", out / "ttft_breakdown.png")
            summary = (Path(tmp) / "bench" / "summary.md").read_text()
            print(summary[summary.index("## TTFT breakdown") :])
            tid = "0af7651916cd43dd8448eb211c80319c"
            body = {"prompt": "Where did my time to first token go? " * 40, "max_tokens": 8}
            headers = {"traceparent": f"00-{tid}-b7ad6b7169203331-01"}
            httpx.post(url + "/completions", json=body, headers=headers, timeout=120)
            want = bytes.fromhex(tid)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                spans = [(svc, s) for svc, s in list(rec.spans) if s.trace_id == want]
                if len(spans) >= 8:
                    break
                time.sleep(0.2)
    draw(spans, out / "trace_timeline.png")
    t0 = min(s.start_time_unix_nano for _, s in spans)
    print("\n| process | span | start ms | duration ms |\n|---|---|---|---|")
    for svc, s in sorted(spans, key=lambda x: x[1].start_time_unix_nano):
        start = (s.start_time_unix_nano - t0) / 1e6
        dur = (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6
        print(f"| {svc} | {s.name} | {start:.1f} | {dur:.1f} |")
    print(f"\nwrote {out / 'ttft_breakdown.png'}, {out / 'trace_timeline.png'}")


if __name__ == "__main__":
    main()
