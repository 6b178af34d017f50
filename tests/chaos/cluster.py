"""A real `pdserve serve` seen from outside: its worker processes, kill -9 / stop / restart of
one worker, and OpenAI-style requests whose outcome is classified (completed, clear error, hung).
The server itself is started and stopped by tests/servers.py.

Shared by tests/chaos, tests/fuzz, tests/security and benchmarks/chaos.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import httpx
from servers import Server, cmdline, environ, exited, metric
from waiting import wait_until

__all__ = ["Cluster", "Outcome", "Server", "complete", "metric", "stream", "wait_until"]


class Cluster:
    """One `pdserve serve` plus the workers this object restarted (it owns those). A context
    manager: leaving it stops those workers and the server."""

    def __init__(self, server: Server, log_dir: Path):
        self.server, self.url, self.log_dir = server, server.url, log_dir
        self.restarted: dict[str, subprocess.Popen] = {}
        # worker id -> how it was started: its command line and environment (serve hands the
        # workers some settings as variables: the OTLP endpoint, ...)
        pids = server.worker_pids()
        self.argv = {wid: cmdline(pid) for wid, pid in pids.items()}
        self.env = {wid: environ(pid) for wid, pid in pids.items()}
        if not self.argv:
            server.stop()
            raise RuntimeError("`pdserve serve` runs no worker process:\n" + "".join(server.lines))

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def control_endpoint(self) -> str:
        """The router's worker socket (workers are started with `--router ENDPOINT`)."""
        argv = next(iter(self.argv.values()))
        return argv[argv.index("--router") + 1]

    def pids(self) -> dict[str, int]:
        """Worker id -> pid of every worker process now running (started by serve or by us)."""
        found = self.server.worker_pids()
        for wid, proc in self.restarted.items():
            if proc.poll() is None:
                found[wid] = proc.pid
        return found

    def health(self) -> dict:
        return self.server.health()["workers"]

    def wait_decoders_idle(self, timeout_s: float = 10.0) -> None:
        """No decode worker reports a running request: call before a stream whose worker
        `busy_decode_worker` will pick, or a report still lagging from an earlier request can
        name the wrong worker."""
        wait_until(
            lambda: not any(h["running"] for h in self.health().values() if h["role"] != "prefill"),
            timeout_s,
            "the decode workers to report no running request",
            interval_s=0.1,
            state=self.health,
        )

    def busy_decode_worker(self, timeout_s: float = 10.0) -> str:
        """The decode worker that reports a running request (load reports lag by ~0.5 s; see
        `wait_decoders_idle`)."""

        def single_busy() -> list[str] | None:
            busy = [w for w, h in self.health().items() if h["role"] != "prefill" and h["running"]]
            return busy if len(busy) == 1 else None

        return wait_until(
            single_busy, timeout_s, "a single busy decode worker", interval_s=0.1, state=self.health
        )[0]

    def signal(self, wid: str, sig: int) -> None:
        os.kill(self.pids()[wid], sig)

    def kill(self, wid: str) -> None:
        """kill -9 and reap, so the process is really gone when this returns."""
        pid = self.pids()[wid]
        os.kill(pid, signal.SIGKILL)
        proc = self.restarted.get(wid)
        if proc is not None and proc.pid == pid:
            proc.wait()
        else:
            wait_until(lambda: exited(pid), 10, f"{wid} (pid {pid}) to exit after SIGKILL")

    def wait_gone(self, wid: str, timeout_s: float = 15.0) -> None:
        """The router has declared `wid` dead (no longer in /health)."""
        wait_until(
            lambda: wid not in self.health(), timeout_s, f"{wid} to leave /health", interval_s=0.1
        )

    def restart(self, wid: str, timeout_s: float = 120.0, extra: tuple[str, ...] = ()) -> None:
        """Start `wid` again with the same command line (and `extra` flags after it) and
        environment; wait until it has re-registered."""
        if wid in self.pids():
            self.kill(wid)
        if wid in self.health():
            self.wait_gone(wid)
        log = open(self.log_dir / f"{wid}-{time.monotonic_ns()}.log", "w")  # noqa: SIM115
        self.restarted[wid] = subprocess.Popen(
            [*self.argv[wid], *extra], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=self.env[wid] or None,
        )  # fmt: skip
        log.close()
        wait_until(lambda: wid in self.health(), timeout_s, f"{wid} to re-register", interval_s=0.1)

    def ensure_all(self, down: tuple[str, ...] = ()) -> None:
        """Every worker the server started is alive and registered (restart those that are not),
        but those in `down`: stopped (kill -9) and gone from /health."""
        for wid in self.argv:
            if wid in down:
                if wid in self.pids():
                    self.kill(wid)
                if wid in self.health():
                    self.wait_gone(wid)
            elif wid not in self.health() or wid not in self.pids():
                self.restart(wid)

    def assert_clean(self, timeout_s: float = 30.0) -> dict:
        """Every live worker idle with all blocks free and an intact block manager (else
        AssertionError naming the workers that are not, and how); /health's workers."""
        return self.server.wait_idle_and_clean(timeout_s)

    def stop(self) -> None:
        """Stop the workers this object restarted, then the server and what it started."""
        for proc in self.restarted.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.restarted.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.server.stop()


class Outcome(NamedTuple):
    """How one request ended. kind: ok | error (an HTTP or SSE error object with a message) |
    unclear (an error without a message, a broken stream) | hung (no end within the timeout)."""

    kind: str
    text: str
    status: int
    message: str | None
    completion_tokens: int | None
    seconds: float


def _error_message(raw: bytes | str) -> str | None:
    try:
        return json.loads(raw)["error"]["message"] or None
    except (ValueError, KeyError, TypeError):
        return None


def complete(url: str, body: dict, timeout_s: float = 60.0, headers=None) -> Outcome:
    """POST a non-streaming completion (or chat completion when `body` has messages)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    t0 = time.monotonic()
    try:
        r = httpx.post(url + path, json=body, timeout=timeout_s, headers=headers)
    except httpx.TimeoutException:
        return Outcome("hung", "", 0, None, None, time.monotonic() - t0)
    except httpx.TransportError as exc:
        return Outcome("unclear", "", 0, repr(exc), None, time.monotonic() - t0)
    dt = time.monotonic() - t0
    if r.status_code != 200:
        msg = _error_message(r.content)
        return Outcome("error" if msg else "unclear", "", r.status_code, msg, None, dt)
    data = r.json()
    choice = data["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return Outcome("ok", text, 200, None, data["usage"]["completion_tokens"], dt)


def stream(
    url: str,
    body: dict,
    timeout_s: float = 60.0,
    on_chunk=None,
    stop_after: int | None = None,
    headers=None,
) -> Outcome:
    """Stream a completion; `on_chunk(n)` runs after the n-th text chunk; `stop_after` chunks
    closes the connection (a client that goes away mid-stream: kind "cancelled")."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    usage, t0 = None, time.monotonic()
    try:
        with httpx.stream("POST", url + path, json=body, timeout=timeout_s, headers=headers) as r:
            if r.status_code != 200:
                msg = _error_message(r.read())
                kind = "error" if msg else "unclear"
                return Outcome(kind, "", r.status_code, msg, None, time.monotonic() - t0)
            for line in r.iter_lines():
                if time.monotonic() - t0 > timeout_s:
                    return Outcome("hung", "".join(parts), 200, None, None, timeout_s)
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    msg = event["error"].get("message")
                    kind = "error" if msg else "unclear"
                    return Outcome(kind, "".join(parts), 200, msg, None, time.monotonic() - t0)
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                    parts.append(delta)
                    if on_chunk is not None:
                        on_chunk(len(parts))
                    if stop_after is not None and len(parts) >= stop_after:
                        return Outcome("cancelled", "".join(parts), 200, None, None, 0.0)
    except httpx.TimeoutException:
        return Outcome("hung", "".join(parts), 200, None, None, time.monotonic() - t0)
    except httpx.TransportError as exc:
        return Outcome("unclear", "".join(parts), 200, repr(exc), None, time.monotonic() - t0)
    tokens = usage["completion_tokens"] if usage else None
    kind = "ok" if usage else "unclear"  # a stream that ends without usage + [DONE] is broken
    return Outcome(kind, "".join(parts), 200, None, tokens, time.monotonic() - t0)
