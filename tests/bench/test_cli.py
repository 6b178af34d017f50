import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.compare import ModeNumbers, verdict
from pdserve.cli import main

from .stub_server import StubConfig, StubServer

STUB = Path(__file__).with_name("stub_server.py")
PNG = b"\x89PNG\r\n\x1a\n"


def test_bench_writes_json_plots_and_markdown_with_every_request(tmp_path, capsys):
    stub = StubConfig(ttft_s=0.005, itl_s=0.0005, fault="close_early", fault_every=5)
    with StubServer(stub) as url:
        code = main(
            ["bench", "--url", url, "--out", str(tmp_path)]
            + "--workload mixed --num-requests 12 --rate 100 --seed 3 --tokenizer none "
            "--no-progress".split()
        )
    assert code == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    (run,) = doc["runs"]
    assert sorted(r["index"] for r in run["records"]) == list(range(12))
    assert run["aggregates"]["num_requests"] == 12
    assert run["aggregates"]["status"] == {"ok": 9, "error": 3, "timeout": 0}  # #0, #5, #10
    assert all(
        r["error"].startswith("stream closed before [DONE]")
        for r in run["records"]
        if r["status"] == "error"
    )
    assert set(run["per_class"]) <= {"chat", "doc"}
    assert doc["config"]["workload"] == "mixed"
    assert doc["config"]["prompt_lengths"] == "approximate (1 word ~ 1 token)"
    plots = ["ttft_cdf.png", "itl_cdf.png"] + [f"itl_cdf_{k}.png" for k in run["per_class"]]
    assert len(plots) == 4  # both classes drawn in 12 requests with this seed
    for name in plots:
        assert (tmp_path / name).read_bytes()[:8] == PNG
    summary = (tmp_path / "summary.md").read_text()
    assert "| run | ok/error/timeout |" in summary
    assert "| run | 9/3/0 |" in summary
    assert "## Failed requests" in summary
    assert "| run | 9/3/0 |" in capsys.readouterr().out


def test_sweep_writes_rate_plots_and_goodput(tmp_path):
    with StubServer(StubConfig(ttft_s=0.002, itl_s=0.0)) as url:
        code = main(
            ["bench", "--url", url, "--out", str(tmp_path)]
            + "--prompt-tokens 5 --output-tokens 2 --num-requests 4 --sweep 50,100 "
            "--tokenizer none --no-progress".split()
        )
    assert code == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["50 req/s", "100 req/s"]
    assert doc["goodput"] == 100
    for name in ("attainment_vs_rate.png", "latency_vs_rate.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    assert "**Goodput: 100 req/s**" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench"], "pdserve bench: error: --url is required"),
        (
            ["bench", "--url", "http://x/v1", "--prompt-tokens", "gauss:3"],
            "bad length distribution 'gauss:3'",
        ),
        (
            ["bench", "--url", "http://x/v1", "--workload", "chat", "--prompt-tokens", "5"],
            "choose one of --workload, --prompt-tokens",
        ),
        (["bench", "--url", "http://x/v1", "--workload", "chatty"], "unknown workload 'chatty'"),
        (
            ["bench", "compare", "--modes", "colocated,fast", "--tokenizer", "none"],
            "unknown mode 'fast'",
        ),
    ],
)
def test_user_errors_are_messages_not_tracebacks(argv, message, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_help_explains_goodput(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "Goodput (DistServe's definition) is the highest request rate at which at least 90 %"
        in text
    )


def test_registering_imports_nothing_heavy():
    code = (
        "import sys, argparse; import pdserve.bench.cli as c; "
        "c.register(argparse.ArgumentParser().add_subparsers()); "
        "print(sorted(m for m in ('numpy', 'aiohttp', 'matplotlib', 'torch', 'msgspec', 'uvloop') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _compare(tmp_path: Path, *extra: str) -> int:
    serve = (
        f"{shlex.quote(sys.executable)} {shlex.quote(str(STUB))} --itl-by-mode "
        "colocated=0.04,colocated+chunked=0.02,disagg=0.005"
    )
    options = (
        "--prompt-tokens 5 --output-tokens 6 --num-requests 4 --rate 50 --tokenizer none "
        "--no-progress --slo-tpot 0.03 --startup-timeout 20"
    )
    serve += "".join(f" {shlex.quote(e)}" for e in extra)
    return main(
        ["bench", "compare", "--out", str(tmp_path), "--serve-cmd", serve, *options.split()]
    )


@pytest.mark.slow
def test_compare_runs_each_mode_and_derives_the_verdict(tmp_path):
    assert _compare(tmp_path) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["colocated", "colocated+chunked", "disagg"]
    itl = [r["aggregates"]["itl_s"]["p50"] for r in doc["runs"]]
    assert itl == sorted(itl, reverse=True)
    # TPOT 40 ms misses the 30 ms target; 20 ms and 5 ms meet it, then ITL breaks the tie.
    assert [r["aggregates"]["slo_attainment"] for r in doc["runs"]] == [0.0, 1.0, 1.0]
    summary = (tmp_path / "summary.md").read_text()
    assert "## Which to use" in summary
    assert "Use disaggregated serving for this workload: it ties on the score" in summary
    assert "disaggregation cut it by" in summary
    for mode in ("colocated", "colocated+chunked", "disagg"):
        assert "ready" in (tmp_path / f"serve-{mode}.log").read_text()


@pytest.mark.slow
def test_compare_reports_a_mode_that_does_not_start(tmp_path):
    assert _compare(tmp_path, "--fail-mode", "disagg") == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "* Not measured: disagg was not measured: `" in summary
    assert "stub: mode disagg is broken on purpose" in summary
    assert "Use co-located serving with chunked prefill" in summary


def test_verdict_follows_the_numbers():
    numbers = [
        ModeNumbers("colocated", 0.95, 0.030, 0.5),
        ModeNumbers("colocated+chunked", 0.80, 0.020, 0.6),
        ModeNumbers("disagg", 0.70, 0.010, 0.9),
    ]
    text = verdict(numbers, sweep=False)
    assert text.startswith(
        "Measured here, SLO attainment was colocated 95 %, colocated+chunked 80 %, disagg 70 %;"
    )
    assert "disaggregation cut it by 67 % versus co-located" in text
    assert text.endswith(
        "Use plain co-located serving: it has the best SLO attainment; at "
        "this load neither chunking nor disaggregation pays for its cost."
    )
    swept = verdict(
        [n._replace(score=s) for n, s in zip(numbers, (1.0, 2.0, 2.0), strict=True)], sweep=True
    )
    assert (
        "goodput (highest rate with >= 90 % of requests within the SLO) was colocated "
        "1 req/s, colocated+chunked 2 req/s, disagg 2 req/s" in swept
    )
    assert "Use disaggregated serving for this workload: it ties on the score" in swept
