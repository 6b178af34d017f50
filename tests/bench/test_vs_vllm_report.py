"""benchmarks/vs_vllm.py --rounds: a server's rounds combined into medians, and each round's
tok/s ratio against vLLM's round beside it, in the table."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _vllm_report import Plan, combine, round_ratios, table  # noqa: E402


def _fig(tok_s, ttft_ms=None, requests=64, errors=0):
    return {
        "tok_s": tok_s,
        "ttft_p50_ms": ttft_ms,
        "ttft_p90_ms": None if ttft_ms is None else 2 * ttft_ms,
        "itl_p50_ms": 10.0,
        "requests": requests,
        "errors": errors,
        "prompt_tokens_mean": 256.0,
        "output_tokens_mean": 128.0,
        "duration_s": 20.0,
    }


def _row(startup, **levels):
    return {"startup_s": startup, "levels": {int(c[1:]): f for c, f in levels.items()}}


def test_combine_takes_medians_sums_counts_and_keeps_the_rounds():
    rounds = [
        _row(4.0, c16=_fig(300.0, 500.0), c64=_fig(400.0, 900.0)),
        {"error": "did not start"},
        _row(6.0, c16=_fig(330.0, 450.0), c64=_fig(380.0, None, errors=1)),
        _row(5.0, c16=_fig(310.0, 470.0)),
    ]
    row = combine(rounds)
    assert row["rounds"] == rounds
    assert row["startup_s"] == 5.0
    assert row["levels"][16]["tok_s"] == 310.0 and row["levels"][16]["ttft_p50_ms"] == 470.0
    assert row["levels"][16]["requests"] == 3 * 64 and row["levels"][16]["duration_s"] == 60.0
    # a level two rounds measured: their median; a figure one of them lacks: the other's
    assert row["levels"][64]["tok_s"] == 390.0
    assert row["levels"][64]["ttft_p50_ms"] == 900.0
    assert row["levels"][64]["errors"] == 1


def test_a_server_no_round_measured_keeps_its_error():
    row = combine([{"error": "first"}, {"error": "second"}])
    assert row["error"] == "first" and len(row["rounds"]) == 2


def test_round_ratios_pair_each_round_with_vllms():
    vllm = combine([_row(80.0, c16=_fig(250.0)), _row(90.0, c16=_fig(200.0))])
    ours = combine([_row(4.0, c16=_fig(375.0)), {"error": "x"}])
    assert round_ratios(ours, vllm, 16) == [pytest.approx(1.5)]
    assert round_ratios(ours, vllm, 64) == []
    assert round_ratios(ours, {}, 16) == []  # vLLM not among the servers


def test_the_table_gives_medians_and_each_rounds_ratio():
    plan = Plan(["vllm", "pdserve"], [16], {16: 64}, 256, 128, 4, "0-1", 1.0, rounds=2)
    vllm = combine([_row(80.0, c16=_fig(250.0, 600.0)), _row(90.0, c16=_fig(200.0, 700.0))])
    ours = combine([_row(4.0, c16=_fig(400.0, 300.0)), _row(5.0, c16=_fig(300.0, 350.0))])
    text = table({"vllm": vllm, "pdserve": ours}, plan)
    assert "medians of 2 rounds" in text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("| pdserve |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    # 350 / 225 tok/s; TTFT 325 / 650 ms; round by round 400 / 250 and 300 / 200
    assert cells[2:4] == ["350.0", "1.56x"]
    assert cells[6] == "0.50x"
    assert cells[-1] == "1.60x / 1.50x"
    one = Plan(["vllm", "pdserve"], [16], {16: 64}, 256, 128, 4, "0-1", 1.0)
    assert "by round" not in table({"vllm": vllm, "pdserve": ours}, one)
