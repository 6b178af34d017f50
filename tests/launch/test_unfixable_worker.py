"""A worker that no restart can fix (the router refused its KV layout, a wrong setting or model)
exits with `EXIT_CONFIG`: `pdserve serve` stops its start-up with the worker's message and a
non-zero status instead of restarting it forever (vLLM #42895); once serving, such a worker is
reported and left down."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from chaos.fakes import FakePrefill, real_layout
from servers import Command, free_port, run_serve
from waiting import wait_until

from pdserve.launch.procs import RestartPolicy, WorkerProcs
from pdserve.subprocs import EXIT_CONFIG, WorkerRefused, cannot_restart

REFUSED = [
    sys.executable,
    "-c",
    f"import sys; print('the router refused this worker: layout', flush=True); "
    f"sys.exit({EXIT_CONFIG})",
]


def test_only_a_refusal_or_a_wrong_setting_is_one_a_restart_cannot_fix():
    assert cannot_restart(WorkerRefused("KV layout mismatch"))
    assert cannot_restart(ValueError("--max-num-seqs must be >= 1"))
    assert cannot_restart(FileNotFoundError("/nonexistent/model.gguf does not exist"))
    assert not cannot_restart(RuntimeError("no router answered registration in 60 s"))
    assert not cannot_restart(OSError("out of memory"))


def test_a_worker_exiting_with_exit_config_is_reported_once_and_never_restarted(capsys):
    procs = WorkerProcs(RestartPolicy(backoff_s=1, max_backoff_s=30, window_s=300))
    try:
        child = procs.spawn("prefill-0", REFUSED, restart=True)
        wait_until(lambda: child.proc.poll() is not None, 30, "prefill-0 to exit")
        procs.check(now=100.0)
        procs.check(now=200.0)  # long past any backoff
        assert child.gone and child.restart_at is None and child.restarts == 0
        assert procs.refused() == ("prefill-0", "the router refused this worker: layout")
        out = capsys.readouterr().out
        assert out.count("prefill-0 cannot serve as configured (exit code 78)") == 1, out
        assert "restarting it" not in out and "restarted prefill-0" not in out
    finally:
        procs.stop()


@pytest.mark.slow
def test_a_kv_layout_mismatch_fails_serve_start_up_with_the_routers_message():
    started = time.monotonic()
    out = run_serve(
        "--host", "127.0.0.1",
        "--prefill-args", "--block-size 32", "--decode-args", "--block-size 16",
        timeout_s=300,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "KV layout mismatch between prefill and decode workers (block_size: " in text, text
    assert "cannot serve as configured" in text and "restarting it" not in text, text
    print(f"serve exited {out.returncode} {time.monotonic() - started:.0f} s after it started")


def test_a_worker_refused_while_serving_exits_78_and_health_names_it():
    """A router already serving (here with one stand-in prefill worker of the bundled model's
    layout) refuses a decode worker of another block size: the worker exits EXIT_CONFIG with
    the router's message, and the router's /health lists it under `refused`."""
    port = free_port()
    ready = r"router on (http://127\.0\.0\.1:\d+)/v1"
    with Command("router", "--port", "0", "--control-port", str(port), ready=ready) as router:
        fake = FakePrefill(f"tcp://127.0.0.1:{port}", "p0", "stall", real_layout("bfloat16"))
        try:
            assert fake.register().ok
            worker = subprocess.run(
                [sys.executable, "-m", "pdserve.cli", "worker", "--role", "decode", "--router",
                 f"tcp://127.0.0.1:{port}", "--worker-id", "d-wrong", "--block-size", "32",
                 "--kv-cache-gb", "0.05"],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert worker.returncode == EXIT_CONFIG, worker.stderr[-2000:]
            assert "KV layout mismatch" in worker.stderr
            refused = httpx.get(router.match[1] + "/health", timeout=10).json()["refused"]
            assert "KV layout mismatch" in refused["d-wrong"]
        finally:
            fake.close()
