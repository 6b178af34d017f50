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


def stops_with_status_0(sig: int, prefix: list[str], handled_within_s: float) -> None:
    """Start a worker with no router there (it is still starting, or waiting for a router's
    answer, when it is told to stop), once it handles `sig` send it, and expect exit 0."""
    port = free_port()
    worker = [sys.executable, "-m", "pdserve.cli", "worker", "--role", "both",
              "--router", f"tcp://127.0.0.1:{port}"]  # fmt: skip
    proc = subprocess.Popen([*prefix, *worker], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        wait_until(lambda: proc.poll() is not None or _catches(proc.pid, sig), handled_within_s,
                   f"the worker to handle signal {sig}")  # fmt: skip
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_worker_that_inherited_sigint_ignored_stops_on_sigint():
    stops_with_status_0(signal.SIGINT, IGNORING_SIGINT, 30)


def test_a_worker_told_to_stop_while_it_waits_for_a_router_leaves_at_once():
    """SIGTERM while it waits for a router's answer to its registration (none comes): it
    leaves unregistered, exit status 0, instead of waiting out the registration's 60 s. (The
    drain handler is installed once the engine is built, right before registering.)"""
    stops_with_status_0(signal.SIGTERM, [], 60)
