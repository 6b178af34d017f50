"""The one launcher of real `pdserve serve` processes (router + worker processes, and the KV store
with --kv-store) for every suite that needs them: tests/serving, launch, chaos, fuzz, security,
kv_store, and benchmarks/chaos.py through tests/chaos/cluster.py.

`Server(*flags)` starts one on a port of its own (--port 0, read back from its ready line) and
returns once it is ready; `stop()` returns once it and every process it started are gone. Use
it as a context manager so that whoever starts a server stops it:

    @pytest.fixture(scope="session")
    def disagg_server():
        with Server("--mode", "disagg") as server:
            yield server

`run_serve(*flags)` runs a `pdserve serve` that is expected to refuse its flags and exit;
`Command("router", ..., ready=REGEX)` starts another `pdserve` process (a router, a worker) as
`Server` starts serve (`Server` is a `Command`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from waiting import wait_until

SERVE = [sys.executable, "-m", "pdserve.cli", "serve"]
READY = re.compile(r"pdserve ready: (http://\S+):(\d+)/v1")


def _environ(env: dict[str, str | None] | None) -> dict[str, str]:
    """os.environ with `env` applied: a value sets a variable, None removes it."""
    out = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def run_serve(
    *flags: str, env: dict[str, str | None] | None = None, timeout_s: float = 120.0
) -> subprocess.CompletedProcess:
    """`pdserve serve --port 0 FLAGS` run to its end: for flags it must refuse before it starts
    anything (a server that does start is killed at `timeout_s`: TimeoutExpired)."""
    cmd = [*SERVE, "--port", "0", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_environ(env))


class Command:
    """One `pdserve ARGS` process other than serve (`router`, `worker`), up once it prints a line
    matching `ready`; `lines`: everything it printed. A context manager: stopped on exit.
    `prefix`: argv it runs under, e.g. a network host's `ip netns exec NS` (which execs: the
    pid is pdserve's own)."""

    def __init__(
        self,
        *args: str,
        ready: str,
        env: dict[str, str | None] | None = None,
        startup_timeout_s: float = 120.0,
        prefix: list[str] | tuple[str, ...] = (),
    ):
        self.lines: list[str] = []
        self.match: re.Match | None = None
        self._ready, self._pattern = threading.Event(), re.compile(ready)
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "pdserve.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # stop() signals its process group, never the test runner
            env=_environ(env),
        )
        self._reader = threading.Thread(target=self._read, daemon=True)  # the pipe never fills
        self._reader.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"`pdserve {' '.join(args)}` did not print {ready!r} within "
                    f"{startup_timeout_s:g} s (exit code {self.proc.returncode}):\n"
                    + "".join(self.lines[-40:])
                )

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if not self._ready.is_set() and (found := self._pattern.search(line)):
                self.match = found
                self._ready.set()

    def __enter__(self) -> Command:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def kill(self) -> None:
        """kill -9, and reap it."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT (serve then stops its workers and store), SIGKILL after `timeout_s`; returns
        once it and every process it had started are gone. Safe to call again."""
        if self.proc.poll() is None:  # once it has exited, its pid may be another process's
            started = children(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            stop_all(started)
        self._reader.join(5)  # the rest of its output, for a failing test's report


class Server(Command):
    """One `pdserve serve FLAGS` process, ready (its workers registered) when constructed.
    `lines`: everything it printed so far (its workers' output included)."""

    def __init__(
        self,
        *flags: str,
        env: dict[str, str | None] | None = None,
        startup_timeout_s: float = 240.0,
    ):
        self.flags = flags
        super().__init__(
            "serve", "--port", "0", *flags,
            ready=READY.pattern, env=env, startup_timeout_s=startup_timeout_s,
        )  # fmt: skip
        self.url, self.port = f"{self.match[1]}:{self.match[2]}", int(self.match[2])

    # -- what it runs ----------------------------------------------------------------------
    def child_pids(self, needle: str = "") -> list[int]:
        """Processes `pdserve serve` started (workers, KV store) whose command line, its words
        joined by spaces and ending in one, contains `needle`."""
        return [pid for pid in children(self.proc.pid) if needle in " ".join(cmdline(pid)) + " "]

    def worker_pids(self) -> dict[str, int]:
        """Worker id -> pid of every worker process it started that is still running."""
        found = {}
        for pid in children(self.proc.pid):
            argv = cmdline(pid)
            if "--worker-id" in argv and not exited(pid):
                found[argv[argv.index("--worker-id") + 1]] = pid
        return found

    # -- what it reports -------------------------------------------------------------------
    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def settle(self, timeout_s: float = 30.0) -> dict:
        """Wait up to `timeout_s` for every worker to be idle and clean (see `unclean`) in a
        load report sent after this call began (an earlier one may predate the request's end);
        return /health's workers either way, for reports that count what leaked instead of
        failing."""
        workers: dict = {}
        start = time.monotonic()

        def clean() -> bool:
            nonlocal workers
            workers = self.health()["workers"]
            since = time.monotonic() - start  # >= the router's clock's time since `start`
            fresh = all(w.get("load_age_s", since) < since for w in workers.values())
            return fresh and not unclean(workers)

        try:
            wait_until(clean, timeout_s, "idle and clean workers", interval_s=0.1)
        except AssertionError:
            pass  # the caller judges `workers`
        return workers

    def wait_idle_and_clean(self, timeout_s: float = 30.0) -> dict:
        """/health's workers once every worker is idle with every KV block free and an intact
        block manager; AssertionError naming each worker that is not, and how, after
        `timeout_s`."""
        workers = self.settle(timeout_s)
        problems = unclean(workers)
        if problems:
            raise AssertionError(
                f"workers not idle and clean after {timeout_s:g} s: "
                + "; ".join(f"{wid}: {why}" for wid, why in problems.items())
            )
        return workers


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a service that must come back on it)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metric(url: str, sample: str) -> float:
    """Value of one Prometheus sample of the router, e.g. 'pdserve_migrations_total'
    (0 when it was never incremented)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def metric_sum(url: str, name: str) -> float:
    """Sum of every sample of one Prometheus metric of the router, over all its labels, e.g.
    'pdserve_requests_total' (0 when it was never incremented)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith((name + " ", name + "{")):
            total += float(line.split()[-1])
    return total


def metric_samples(url: str, name: str) -> dict[tuple[str, ...], float]:
    """Every sample of one labelled Prometheus metric of the router: its label values (in the
    order printed) -> value, e.g. {("up", "prefill"): 1.0} for pdserve_scale_events_total."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            out[tuple(re.findall(r'="([^"]*)"', line.split("}")[0]))] = float(line.split()[-1])
    return out


def live_workers(url: str) -> tuple[int, int]:
    """(prefill, decode) workers live and not draining (the pdserve_workers gauge)."""
    workers = metric_samples(url, "pdserve_workers")
    return int(workers[("prefill",)]), int(workers[("decode",)])


def scale_events(url: str, direction: str) -> float:
    """Workers the autoscaler started ("up") or drained ("down") so far."""
    events = metric_samples(url, "pdserve_scale_events_total")
    return sum(v for labels, v in events.items() if direction in labels)


def unclean(workers: dict) -> dict[str, str]:
    """Worker id -> what is not idle and clean about it: a request running, waiting or
    transferring, a KV block not free, a block manager integrity error. No worker at all is
    not clean either."""
    if not workers:
        return {"(none)": "no worker is registered"}
    problems = {}
    for wid, w in workers.items():
        why = [f"{k}={w.get(k)}" for k in ("running", "waiting", "transferring") if w.get(k) != 0]
        if w.get("free_blocks") != w.get("total_blocks"):
            why.append(f"free_blocks={w.get('free_blocks')} of {w.get('total_blocks')}")
        if w.get("integrity_error") is not None:
            why.append(f"integrity_error={w['integrity_error']!r}")
        if why:
            problems[wid] = ", ".join(why)
    return problems


def stop_all(pids: list[int], timeout_s: float = 15.0) -> None:
    """Wait until every pid has exited (they were told to); SIGKILL those left after
    `timeout_s`."""
    try:
        wait_until(lambda: all(exited(p) for p in pids), timeout_s, "processes to exit")
    except AssertionError:
        for pid in pids:
            if not exited(pid):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: all(exited(p) for p in pids), 10, f"{pids} to die after SIGKILL")


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


def tcp_sockets(pid: int) -> list[tuple[int, int, str]]:
    """(local port, remote port, state: "LISTEN", "ESTABLISHED", ...) of each IPv4 TCP socket
    `pid` holds (its fds' inodes matched in /proc/PID/net/tcp; psutil is not a dependency)."""
    states = {"01": "ESTABLISHED", "0A": "LISTEN"}
    try:
        inodes = {
            link.removeprefix("socket:[").rstrip("]")
            for link in (os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir())
            if link.startswith("socket:[")
        }
        rows = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return []  # exited while we looked
    out = []
    for row in rows:
        f = row.split()
        if f[9] in inodes:
            local, remote = (int(a.rsplit(":", 1)[1], 16) for a in f[1:3])
            out.append((local, remote, states.get(f[3], f[3])))
    return out


def cmdline(pid: int) -> list[str]:
    """The argv of `pid` ([] once it has exited)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]
    except OSError:
        return []


def environ(pid: int) -> dict[str, str]:
    """The environment `pid` was started with ({} once it has exited)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


def exited(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
