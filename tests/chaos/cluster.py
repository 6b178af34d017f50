"""A real `pdserve serve` seen from outside: its worker processes (found under /proc, since
`pdserve serve` starts them as its children), kill -9 / stop / restart of one worker, and
OpenAI-style requests whose outcome is classified (completed, clear error, hung).

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
from serving.conftest import Server

__all__ = ["Cluster", "Outcome", "Server", "children", "complete", "metric", "stream"]


def metric(url: str, sample: str) -> float:
    """Value of one Prometheus sample of the router, e.g. 'pdserve_migrations_total'
    (0 when it was never incremented)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc/*/stat; psutil is not a dependency)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


class Cluster:
    """One `pdserve serve` plus the workers this object restarted (it owns those)."""

    def __init__(self, server: Server, log_dir: Path):
        self.server, self.url, self.log_dir = server, server.url, log_dir
        self.argv: dict[str, list[str]] = {}  # worker id -> how it was started
        self.restarted: dict[str, subprocess.Popen] = {}
        for pid in children(server.proc.pid):
            argv = cmdline(pid)
            if "worker" in argv:
                self.argv[flag(argv, "--worker-id")] = argv

    @property
    def control_endpoint(self) -> str:
        """The router's worker socket (workers are started with `--router ENDPOINT`)."""
        return flag(next(iter(self.argv.values())), "--router")

    def pids(self) -> dict[str, int]:
        """Worker id -> pid of every worker process now running (started by serve or by us)."""
        found = {}
        for pid in children(self.server.proc.pid):
            argv = cmdline(pid) if Path(f"/proc/{pid}").exists() else []
            if "--worker-id" in argv:
                found[flag(argv, "--worker-id")] = pid
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
        )

    def busy_decode_worker(self, timeout_s: float = 10.0) -> str:
        """The decode worker that reports a running request (load reports lag by ~0.5 s; see
        `wait_decoders_idle`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = [w for w, h in self.health().items() if h["role"] != "prefill" and h["running"]]
            if len(busy) == 1:
                return busy[0]
            time.sleep(0.1)
        raise AssertionError(f"no single busy decode worker within {timeout_s}s: {self.health()}")

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
            wait_until(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), 10, "exit")

    def wait_gone(self, wid: str, timeout_s: float = 15.0) -> None:
        """The router has declared `wid` dead (no longer in /health)."""
        wait_until(lambda: wid not in self.health(), timeout_s, f"{wid} to leave /health")

    def restart(self, wid: str, timeout_s: float = 120.0) -> None:
        """Start `wid` again with the same command line; wait until it has re-registered."""
        if wid in self.pids():
            self.kill(wid)
        if wid in self.health():
            self.wait_gone(wid)
        log = open(self.log_dir / f"{wid}-{time.monotonic_ns()}.log", "w")  # noqa: SIM115
        self.restarted[wid] = subprocess.Popen(
            self.argv[wid], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        wait_until(lambda: wid in self.health(), timeout_s, f"{wid} to re-register")

    def ensure_all(self) -> None:
        """Every worker the server started is alive and registered (restart those that are not)."""
        for wid in self.argv:
            if wid not in self.health() or wid not in self.pids():
                self.restart(wid)

    def assert_clean(self, timeout_s: float = 30.0) -> dict:
        """Every live worker idle with all blocks free and an intact block manager."""
        workers = self.server.wait_idle_and_clean(timeout_s)
        leaked = {w: h["total_blocks"] - h["free_blocks"] for w, h in workers.items()}
        assert leaked == dict.fromkeys(workers, 0), workers
        assert [h["integrity_error"] for h in workers.values()] == [None] * len(workers)
        return workers

    def stop(self) -> None:
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


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)


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
    url: str, body: dict, timeout_s: float = 60.0, on_chunk=None, stop_after: int | None = None
) -> Outcome:
    """Stream a completion; `on_chunk(n)` runs after the n-th text chunk; `stop_after` chunks
    closes the connection (a client that goes away mid-stream: kind "cancelled")."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    usage, t0 = None, time.monotonic()
    try:
        with httpx.stream("POST", url + path, json=body, timeout=timeout_s) as r:
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
