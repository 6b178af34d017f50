"""The soak benchmark's short version (`benchmarks/soak.py --duration 75 --sample-s 3`):
`pdserve serve` (1 P + 1 D) under the mixed workload for 75 s, sampled every 3 s (~8 samples
a third). Every request completes, no KV block is held once the load stops, threads do not
grow, no fd is left open (each process's open fds once the clients have closed and its counts
have settled, against its fewest under load: a client's connection open under load is not a
leak), and no process's RSS floor (its least RSS over a third of the run: what it keeps, not a
long prompt's activations in flight at a sample) grows by more than 5 % from the middle third
to the last (the 30-minute run is the benchmark's; its figures are in docs/reliability.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
DURATION_S = 75  # two minutes until 2026-12-06: the suite's longest test, 150 s of ~35 min


def test_a_soak_of_mixed_load_leaves_nothing_behind(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--duration", str(DURATION_S), "--sample-s", "3",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=DURATION_S + 300,
    )  # fmt: skip
    report = proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = json.loads((tmp_path / "soak.json").read_text())
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    records = [r for run in results["runs"] for r in run["records"]]
    assert records and all(r.get("status") == "ok" for r in records), report
    assert not any(samples[-1]["held_blocks"].values()), report
    loaded = [s for s in samples if s["t"] <= DURATION_S]
    settled, end = loaded[len(loaded) // 3], loaded[-1]
    assert set(end["procs"]) >= {"router", "prefill-0", "decode-1"}, end["procs"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    middle, last_third = summary["rss_floor_mb"]["middle"], summary["rss_floor_mb"]["last"]
    fd_floor, fds_idle = summary["fds"]["floor"], summary["fds"]["idle"]
    for name, last in end["procs"].items():
        start = settled["procs"][name]
        assert fds_idle[name] <= fd_floor[name] + 2, (name, fd_floor, fds_idle, summary["settled"])
        assert last["threads"] <= start["threads"] + 2, (name, start, last)
        assert last_third[name] < 1.05 * middle[name], (name, middle, last_third, report)
