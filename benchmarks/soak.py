"""Soak: `pdserve serve` (1 prefill + 1 decode worker) under the mixed workload for a long time,
sampling every process's RSS, open file descriptors and threads, and the workers' free KV
blocks, every `--sample-s` seconds. Prints each process's RSS floor (its least RSS) over the
middle and the last third of the run and the growth between them, each process's open fds once
the load's clients have closed and the counts have settled against their floor under load, the
blocks still held at the end, and TTFT/ITL p99 of the first and last fifths; writes the samples
(soak.json), the floors, settled counts and verdicts (summary.json) and a plot (soak.png) to
`--out`.

    .venv/bin/python benchmarks/soak.py [--rate 0.4] [--duration 600] [--out soak-results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _servers import server  # noqa: E402

PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def tree(root: int) -> dict[int, str]:
    """pid -> a name for the serve process and its descendants (router, workers)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in cmd if w]
        role = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "--worker-id"), None)
        out[pid] = role or ("router" if pid == root else " ".join(words[2:4]))
        todo += [c for c, p in parents.items() if p == pid]
    return out


def sample(pid: int) -> dict | None:
    try:
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None
    return {"rss_mb": rss_pages * PAGE_KB / 1024, "fds": fds, "threads": threads}


def sampler(root: int, health_url: str, every_s: float, stop: threading.Event, out: list):
    t0 = time.monotonic()
    while not stop.is_set():
        row = {"t": round(time.monotonic() - t0, 1), "procs": {}}
        for pid, name in tree(root).items():
            s = sample(pid)
            if s is not None:
                row["procs"][name] = s
        try:
            workers = httpx.get(health_url, timeout=10).json()["workers"]
            row["held_blocks"] = {
                w: v["total_blocks"] - v["free_blocks"] for w, v in workers.items()
            }
        except (httpx.HTTPError, KeyError, ValueError):
            row["held_blocks"] = None
        out.append(row)
        stop.wait(every_s)


def rss_floors(loaded: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
    """Per process, the least RSS over the middle third of the run and over the last third.
    A sample taken while a long prompt is being prefilled also counts its activations (freed,
    and given back, when it ends): the floor is what the process keeps, so it is what a leak
    would raise."""
    n = len(loaded)

    def floor(window: list[dict]) -> dict[str, float]:
        names = set().union(*(s["procs"] for s in window))
        return {p: min(s["procs"][p]["rss_mb"] for s in window if p in s["procs"]) for p in names}

    return floor(loaded[n // 3 : 2 * n // 3]), floor(loaded[2 * n // 3 :])


def fd_floors(loaded: list[dict]) -> dict[str, int]:
    """Per process, the fewest open fds over the middle third of the run: warmed up, with as few
    client connections open as the load left at any sample."""
    window = loaded[len(loaded) // 3 : 2 * len(loaded) // 3]
    names = set().union(*(s["procs"] for s in window))
    return {p: min(s["procs"][p]["fds"] for s in window if p in s["procs"]) for p in names}


def settle(root: int, deadline_s: float = 60.0, every_s: float = 0.5, polls: int = 4) -> dict:
    """Every process's counts once its open fds and threads have not changed over `polls`
    samples in a row (`every_s` apart), or at the deadline. Called once the load's clients are
    gone: a connection still open under load is not a leak, an fd still open now is."""
    t0, last, same = time.monotonic(), None, 0
    while True:
        now = {name: s for pid, name in tree(root).items() if (s := sample(pid)) is not None}
        counts = {name: (s["fds"], s["threads"]) for name, s in now.items()}
        same = same + 1 if counts == last else 0
        last, waited = counts, time.monotonic() - t0
        if same >= polls - 1 or waited > deadline_s:
            return {"procs": now, "stable": same >= polls - 1, "after_s": round(waited, 1)}
        time.sleep(every_s)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rate", type=float, default=0.4, help="requests/s (Poisson)")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--out", default="soak-results")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    samples: list[dict] = []
    stop = threading.Event()
    serve = server("disagg")
    with serve as url:
        root = serve.proc.pid  # pdserve serve: the router; its children the workers
        health = url.removesuffix("/v1") + "/health"
        thread = threading.Thread(target=sampler, args=(root, health, args.sample_s, stop, samples))
        thread.start()
        bench = [sys.executable, "-m", "pdserve.cli", "bench", "--url", url, "--workload", "mixed",
                 "--rate", str(args.rate), "--duration", str(args.duration), "--out",
                 str(out / "bench"), "--no-progress"]  # fmt: skip
        subprocess.run(bench, check=True)
        time.sleep(2 * args.sample_s)  # the idle tail: what is still held after the load
        stop.set()
        thread.join()  # no /health poll of the sampler's in flight while the counts settle
        settled = settle(root)
    (out / "soak.json").write_text(json.dumps(samples))
    return 0 if report(samples, settled, out, args) else 1


def report(samples: list[dict], settled: dict, out: Path, args) -> bool:
    """Print the figures and a PASS/FAIL line per target; True if all pass."""
    results = json.loads((out / "bench" / "results.json").read_text())
    records = [r for run in results["runs"] for r in run["records"]]
    ok = [r for r in records if r.get("status") == "ok"]
    window = min(300.0, args.duration / 5)  # first and last 5 minutes (a fifth if shorter)

    def p99(rs, key):
        vals = [x for r in rs for x in (r[key] if isinstance(r[key], list) else [r[key]])]
        return float(np.percentile(vals, 99)) if vals else float("nan")

    first = [r for r in ok if r["start_s"] < window]
    last = [r for r in ok if r["start_s"] >= args.duration - window]
    print(f"\nrequests {len(records)}, ok {len(ok)}, errors {len(records) - len(ok)}")
    ttft, itl = (
        (p99(first, "ttft_s"), p99(last, "ttft_s")),
        (p99(first, "itl_s"), p99(last, "itl_s")),
    )
    print(f"TTFT p99 first/last {window:.0f} s: {ttft[0]:.2f} / {ttft[1]:.2f} s; "
          f"ITL p99: {itl[0] * 1e3:.0f} / {itl[1] * 1e3:.0f} ms")  # fmt: skip
    verdicts = {
        "no errors": len(ok) == len(records),
        "TTFT p99 last within 20 % of first": ttft[1] <= 1.2 * ttft[0],
        "ITL p99 last within 20 % of first": itl[1] <= 1.2 * itl[0],
    }
    loaded = [s for s in samples if s["t"] <= args.duration]
    middle, last_third = rss_floors(loaded)
    fd_floor, idle = fd_floors(loaded), settled["procs"]
    end = loaded[-1]
    print(f"{'process':<12} {'RSS start':>10} {'RSS floor 2/3':>13} {'RSS floor 3/3':>13} "
          f"{'growth':>7} {'fds':>9} {'fds floor->idle':>15} {'threads':>9}")  # fmt: skip
    for name in end["procs"]:
        a, b = middle.get(name), last_third.get(name)
        first_s = loaded[0]["procs"].get(name, end["procs"][name])
        last_s = end["procs"][name]
        if a is None or b is None:
            continue
        growth = (b - a) / a * 100
        verdicts[f"{name} RSS growth < 5 %"] = growth < 5
        if name in fd_floor:
            left = idle[name]["fds"] if name in idle else None
            verdicts[f"{name} fds once idle <= floor under load + 2"] = (
                left is not None and left <= fd_floor[name] + 2
            )
        fds = f"{first_s['fds']}->{last_s['fds']}"
        fds_idle = f"{fd_floor.get(name)}->{idle.get(name, {}).get('fds')}"
        threads = f"{first_s['threads']}->{last_s['threads']}"
        print(f"{name:<12} {first_s['rss_mb']:>8.0f}MB {a:>11.0f}MB {b:>11.0f}MB {growth:>6.1f}% "
              f"{fds:>9} {fds_idle:>15} {threads:>9}")  # fmt: skip
    print(f"idle counts {'settled' if settled['stable'] else 'NOT settled'} after "
          f"{settled['after_s']} s")  # fmt: skip
    held = samples[-1].get("held_blocks")
    print(f"blocks held at the end (idle): {held}")
    verdicts["no block held at the end"] = held is not None and not any(held.values())
    for what, passed in verdicts.items():
        print(f"{'PASS' if passed else 'FAIL'}  {what}")
    summary = {
        "rss_floor_mb": {"middle": middle, "last": last_third},
        "fds": {"floor": fd_floor, "idle": {n: s["fds"] for n, s in idle.items()}},
        "settled": {"stable": settled["stable"], "after_s": settled["after_s"]},
        "verdicts": verdicts,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        for name in end["procs"]:
            pts = [(s["t"], s["procs"][name]["rss_mb"]) for s in samples if name in s["procs"]]
            ax.plot(*zip(*pts, strict=True), label=name)
        ax.set_xlabel("seconds")
        ax.set_ylabel("RSS (MB)")
        ax.legend()
        fig.savefig(out / "soak.png", dpi=100, bbox_inches="tight")
        print(f"plot: {out / 'soak.png'}")
    except ImportError:
        pass
    return all(verdicts.values())


if __name__ == "__main__":
    sys.exit(main())
