"""A `pdserve worker` started with SIGINT ignored, as a non-interactive shell starts its background
jobs (and CI its test runner, whose children inherit it), still stops on SIGINT with exit status
0: Python installs no KeyboardInterrupt handler for a signal it inherits ignored, and a launcher
that stops workers with SIGINT (tests/servers.py `Command.stop`) waited 30 s for its SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from servers import free_port
from waiting import wait_until

IGNORING_SIGINT = ["sh", "-c", 'trap "" INT; exec "$@"', "sh"]


def _catches(pid: int, sig: int) -> bool:
    """Whether `pid` has a handler for `sig` (SigCgt in /proc: a hex mask, bit sig-1)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)


def test_a_worker_that_inherited_sigint_ignored_stops_on_sigint():
    port = free_port()  # no router there: the worker is still starting when it is told to stop
    worker = [sys.executable, "-m", "pdserve.cli", "worker", "--role", "both",
              "--router", f"tcp://127.0.0.1:{port}"]  # fmt: skip
    proc = subprocess.Popen([*IGNORING_SIGINT, *worker], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        wait_until(lambda: proc.poll() is not None or _catches(proc.pid, signal.SIGINT), 30,
                   "the worker to handle SIGINT")  # fmt: skip
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_worker_told_to_stop_while_it_waits_for_a_router_leaves_at_once():
    """SIGTERM while it waits for a router's answer to its registration (none comes): it
    leaves unregistered, exit status 0, instead of waiting out the registration's 60 s."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "worker", "--role", "both",
                             "--router", f"tcp://127.0.0.1:{port}"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        # the drain handler is installed once the engine is built, right before registering
        wait_until(lambda: proc.poll() is not None or _catches(proc.pid, signal.SIGTERM), 60,
                   "the worker to handle SIGTERM")  # fmt: skip
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
