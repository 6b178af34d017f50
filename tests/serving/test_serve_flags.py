"""`pdserve serve` refuses bad flag values before starting anything, saying what to change."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--decode-chunk-size", "10"], "--decode-chunk-size must be 0 (off) or at least"),
        (["--slo-ttft", "0"], "--slo-ttft must be a positive number of seconds"),
        (["--slo-tpot", "-1"], "--slo-tpot must be a positive number of seconds"),
    ],
)
def test_bad_flags_exit_2_with_a_message(flags, message):
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", "0", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
