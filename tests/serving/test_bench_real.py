"""`pdserve bench` against the real server: every request accounted for, every artefact written."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_mixed_8_requests_against_pdserve(disagg_server, tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "bench",
        "--url",
        disagg_server.url + "/v1",
        "--workload",
        "mixed",
        "--num-requests",
        "8",  # seed 0 draws one document among them (2,206 tokens: most of the run's time)
        "--rate",
        "2",
        "--out",
        str(out),
        "--no-progress",
        "--timeout",
        "900",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    records = results["runs"][0]["records"]
    assert len(records) == 8
    statuses = {r["status"] for r in records}
    assert statuses <= {"ok", "error", "timeout"}
    assert sum(r["status"] == "ok" for r in records) == 8, [
        r["error"] for r in records if r["error"]
    ]
    assert {r["klass"] for r in records} == {"chat", "doc"}
    assert (out / "summary.md").exists()
    assert list(out.glob("*.png"))
    disagg_server.wait_idle_and_clean()  # raises naming what is still busy or leaked
