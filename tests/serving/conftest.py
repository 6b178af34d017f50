"""Start a real `pdserve serve` (router + worker processes) on a free port, stop it after."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        deadline = time.monotonic() + 240
        for line in self.proc.stdout:
            self.lines.append(line)
            if "pdserve ready" in line:
                break
            if time.monotonic() > deadline:
                break
        if self.proc.poll() is not None or "pdserve ready" not in "".join(self.lines):
            self.stop()
            raise RuntimeError("pdserve serve did not start:\n" + "".join(self.lines[-40:]))
        import threading

        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle_and_clean(self, timeout_s: float = 30.0) -> dict:
        """Every worker idle, every block free, block manager integrity intact."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.health()["workers"]
            clean = all(
                w.get("free_blocks") == w.get("total_blocks")
                and w.get("running") == w.get("waiting") == w.get("transferring") == 0
                and w.get("integrity_error") is None
                for w in workers.values()
            )
            if clean or time.monotonic() > deadline:
                return workers
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="session")
def disagg_server():
    """float32 so that outputs can be compared token for token with the offline engine;
    threshold 0 so that every prompt goes through the prefill pool."""
    server = Server(
        "--mode",
        "disagg",
        "--dtype",
        "float32",
        "--local-prefill-threshold",
        "0",
        "--kv-cache-gb",
        "1.0",  # holds the bench test's working set (docs of 2-4k tokens) without preemption
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def colocated_server():
    server = Server("--mode", "colocated", "--dtype", "float32", "--kv-cache-gb", "0.5")
    yield server
    server.stop()
