"""`pdserve serve` supervises its workers: one that exits is reported with its last output and
restarted after a backoff that doubles per recent crash; the real server serves again after
kill -9 of its decode worker, answering 503 with Retry-After meanwhile."""

from __future__ import annotations

import os
import signal
import sys
import time

import httpx
import pytest
from servers import Server
from waiting import wait_until

from pdserve.launch.procs import RestartPolicy, WorkerProcs

CRASH = [sys.executable, "-c", "import sys; print('boom: out of luck', flush=True); sys.exit(3)"]


def test_the_backoff_doubles_per_crash_in_the_window_up_to_the_cap():
    policy = RestartPolicy(backoff_s=1, max_backoff_s=30, window_s=300)
    assert policy.delay([0.0], now=0.0) == 1
    assert policy.delay([0.0, 10.0], now=10.0) == 2
    assert policy.delay([0.0, 10.0, 20.0], now=20.0) == 4
    assert policy.delay([0.0, 200.0, 400.0], now=400.0) == 2  # the first is out of the window
    assert policy.delay([float(t) for t in range(10)], now=9.0) == 30


@pytest.fixture
def procs():
    p = WorkerProcs(RestartPolicy(backoff_s=1, max_backoff_s=30, window_s=300))
    yield p
    p.stop()


def _exited(child) -> None:
    wait_until(lambda: child.proc.poll() is not None, 30, f"{child.name} to exit")


def test_an_exit_is_reported_with_its_output_and_restarted_after_the_backoff(procs, capsys):
    child = procs.spawn("w0", CRASH, restart=True)
    _exited(child)
    first = child.proc
    procs.check(now=100.0)
    out = capsys.readouterr().out
    assert "w0 exited with code 3" in out and "boom: out of luck" in out
    assert "restarting it in 1 s" in out and child.restart_at == 101.0
    procs.check(now=100.5)
    assert child.proc is first  # not before the backoff
    procs.check(now=101.0)
    assert child.proc is not first and child.restarts == 1
    assert "restarted w0" in capsys.readouterr().out
    _exited(child)
    procs.check(now=102.0)  # the second crash in the window: twice the wait
    assert child.restart_at == 104.0 and "restarting it in 2 s" in capsys.readouterr().out


def test_a_child_without_restart_is_reported_once_and_stop_restarts_nothing(procs, capsys):
    child = procs.spawn("store", CRASH, restart=False)
    _exited(child)
    procs.check(now=1.0)
    procs.check(now=2.0)
    out = capsys.readouterr().out
    assert out.count("store exited with code 3 and is not restarted") == 1 and child.gone
    other = procs.spawn("w0", CRASH, restart=True)
    _exited(other)
    procs.stop()
    procs.check(now=3.0)
    assert other.restart_at is None and other.restarts == 0


SIGTERM_LEAVES = [sys.executable, "-c", (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)"
)]  # fmt: skip


def test_a_drained_child_is_not_restarted_whatever_its_exit(procs, capsys):
    """The autoscaler's scale-down: `drain` sends SIGTERM; the child leaves (exit 0) and is not
    restarted; one that dies otherwise while draining is not restarted either."""
    child = procs.spawn("decode-3", SIGTERM_LEAVES, restart=True)
    procs.wait_for_line(child, "ready", 30)
    procs.drain("decode-3")
    _exited(child)
    procs.check(now=1.0)
    assert child.gone and child.restart_at is None
    assert "decode-3 drained and exited; not restarted" in capsys.readouterr().out
    other = procs.spawn("decode-4", CRASH, restart=True)
    procs.drain("decode-4")
    _exited(other)
    procs.check(now=2.0)
    assert other.gone and other.restart_at is None and other.restarts == 0


def test_a_decode_worker_killed_is_restarted_and_the_server_serves_again():
    with Server("--heartbeat-timeout-s", "2") as server:
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        url = server.url + "/v1/completions"
        first = httpx.post(url, json=body, timeout=60)
        assert first.status_code == 200
        old = server.worker_pids()["decode-1"]
        os.kill(old, signal.SIGKILL)
        killed_at = time.monotonic()
        assert httpx.get(server.url + "/live", timeout=10).status_code == 200
        statuses = []

        def served() -> bool:
            r = httpx.post(url, json=body, timeout=60)
            statuses.append(r.status_code)
            if r.status_code == 503:  # no decode worker meanwhile: retry, as told
                assert int(r.headers["retry-after"]) >= 1, r.headers
            return r.status_code == 200

        wait_until(served, 180, "a request served after kill -9 of the decode worker",
                   interval_s=0.5, state=lambda: statuses[-5:])  # fmt: skip
        back_s = time.monotonic() - killed_at
        assert set(statuses) <= {200, 503}, statuses
        assert (
            httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
            == (first.json()["choices"][0]["text"])
        )
        assert server.worker_pids()["decode-1"] != old
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert httpx.get(server.url + "/live", timeout=10).json() == {"status": "ok"}
        log = "".join(server.lines)
        assert "decode-1 exited with code -9" in log and "restarted decode-1" in log
        print(f"served again {back_s:.1f} s after kill -9 of the decode worker")
        server.wait_idle_and_clean()
