"""The processes `pdserve serve` starts (workers, the KV store), supervised: a worker that exits
while the server runs is restarted with the same command line, after a backoff that doubles with
each crash in the last `RestartPolicy.window_s` (1 s, 2 s, 4 s ... at most 30 s), and every exit
is reported with the process's last lines of output. A restarted worker warms up, registers again
under its id and serves; the router migrates or re-prefills what it held, as for any lost worker.
A worker that exits with `subprocs.EXIT_CONFIG` cannot serve as configured (the router refused
its KV layout, a wrong setting or model): it is reported and left down, and during start-up
`serve` stops with its error (`refused`), since a restart would fail the same way.
The KV store is not restarted (workers treat a store that is gone as "compute it"); `pdserve
serve --no-restart` leaves restarting to an outside supervisor (systemd, Kubernetes).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.subprocs import EXIT_CONFIG, die_with_parent

log = logging.getLogger("pdserve.serve")
TAIL_LINES = 40  # of each process's output, kept for the report when it exits


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    window_s: float = 300.0  # crashes older than this no longer lengthen the backoff

    def recent(self, crash_times: list[float], now: float) -> int:
        """How many of the exits at `crash_times` fall in the window."""
        return sum(now - t <= self.window_s for t in crash_times)

    def delay(self, crash_times: list[float], now: float) -> float:
        """Seconds to wait before restarting, given the times of its exits (the last included)."""
        recent = self.recent(crash_times, now)
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, recent - 1))


@dataclass
class Child:
    name: str
    cmd: list[str]
    restart: bool
    proc: subprocess.Popen | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    unsent: list[str] = field(default_factory=list)  # printed before output is forwarded
    crashes: list[float] = field(default_factory=list)
    restart_at: float | None = None  # set while it waits to be restarted
    restarts: int = 0
    gone: bool = False  # exited, reported, not to be restarted
    draining: bool = False  # sent SIGTERM to leave (scale-down): not restarted whatever its exit
    refused: str | None = None  # its last output, when it exited with EXIT_CONFIG
    pump: threading.Thread | None = None


class WorkerProcs:
    """The subprocesses of `pdserve serve`; their output is kept (and forwarded to stderr once
    `forward_output` is called), exits are restarted while `supervise` runs, all stop together."""

    # once one worker has registered, one that fails to start is restarted like any other
    start_failures_are_final = False

    def __init__(self, policy: RestartPolicy | None = None, restart: bool = True):
        self.policy = policy or RestartPolicy()
        self.restart = restart
        self.children: list[Child] = []
        self.forward = False
        self.stopping = threading.Event()
        self._lock = threading.Lock()  # the children list, against the supervising thread
        self._out_lock = threading.Lock()  # output: kept, or forwarded in order

    def start(
        self,
        worker_id: str,
        role: str,
        cpus: str,
        router: str,
        engine_argv: list[str],
        transport: str,
        tp: int = 1,
        stages: int = 1,
    ) -> Child:
        """Start a worker process pinned to `cpus`; its `tp` processes (ranks, or `stages`
        pipeline stages) share them (`engine/tp/rank.py` pins each to its part)."""
        cmd = [
            sys.executable, "-m", "pdserve.cli", "worker", "--role", role, "--router", router,
            "--worker-id", worker_id, "--cpus", cpus, "--kv-transport", transport, *engine_argv,
        ]  # fmt: skip
        return self.spawn(worker_id, cmd, restart=self.restart)

    def spawn(self, name: str, cmd: list[str], restart: bool = False) -> Child:
        child = Child(name, cmd, restart)
        self._launch(child)
        with self._lock:
            self.children.append(child)
        return child

    def _launch(self, child: Child) -> None:
        child.proc = subprocess.Popen(
            child.cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        child.pump = threading.Thread(target=self._pump, args=(child, child.proc), daemon=True)
        child.pump.start()

    def _pump(self, child: Child, proc: subprocess.Popen) -> None:
        """Keep the child's last lines (the pipe never fills); forward them, once asked to,
        with what it printed before."""
        for line in proc.stdout:
            with self._out_lock:
                child.tail.append(line)
                if self.forward:
                    sys.stderr.write(f"[{child.name}] {line}")
                else:
                    child.unsent.append(line)

    def start_store(
        self,
        store_dir: str | None,
        dram_gb: float,
        ssd_gb: float,
        transport: str = "tcp",
        backend: str = "pdserve",
    ) -> str:
        """Start `pdserve store` (block bytes over `transport`: tcp or nixl) and return its
        endpoint (tcp:// or nixl://) once it listens; with backend "mooncake", a loopback
        `mooncake_master` instead (mooncake://: each worker contributes `dram_gb` to its pool)."""
        import tempfile

        if backend == "mooncake":
            from pdserve.kv_store.mooncake_setup import master_command
            from pdserve.subprocs import free_port

            port, metrics = free_port(), free_port()
            child = self.spawn("mooncake-master", master_command("127.0.0.1", port, metrics))
            self.wait_for_line(child, "Master service started", timeout_s=60)
            return f"mooncake://127.0.0.1:{port}?segment_mb={max(16, int(dram_gb * 1024))}"

        store_dir = store_dir or tempfile.mkdtemp(prefix="pdserve-store-")
        cmd = [
            sys.executable, "-m", "pdserve.cli", "store", "--port", "0", "--store-dir", store_dir,
            "--dram-gb", str(dram_gb), "--ssd-gb", str(ssd_gb), "--transport", transport,
        ]  # fmt: skip
        child = self.spawn("store", cmd)
        line = self.wait_for_line(child, "listening on ", timeout_s=120)
        return line.split("listening on ", 1)[1].split()[0]

    def wait_for_line(self, child: Child, text: str, timeout_s: float) -> str:
        """The first line of the child's output that contains `text` (RuntimeError with its
        output if it exits or `timeout_s` passes first)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(child.tail):
                if text in line:
                    return line
            if child.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{child.name} did not print {text!r}:\n{''.join(child.tail)}")

    def forward_output(self) -> None:
        """Every child's output goes to our stderr, prefixed with its name: what it printed so
        far, then each line as it comes."""
        with self._out_lock:
            for child in self.children:
                for line in child.unsent:
                    sys.stderr.write(f"[{child.name}] {line}")
                child.unsent.clear()
            self.forward = True

    def failed(self) -> tuple[str, str] | None:
        """(name, its last output) of the first child that exited."""
        for child in self.children:
            if child.proc.poll() is not None:
                return child.name, "".join(child.tail)
        return None

    def refused(self) -> tuple[str, str] | None:
        """(name, its last output) of the first worker that cannot serve as configured."""
        for child in self.children:
            if child.refused is not None:
                return child.name, child.refused
        return None

    # -- supervision -----------------------------------------------------------------------
    def supervise(self, interval_s: float = 0.5) -> threading.Thread:
        """Watch the children on a thread of its own until `stop`."""
        thread = threading.Thread(target=self._watch, args=(interval_s,), daemon=True)
        thread.start()
        return thread

    def _watch(self, interval_s: float) -> None:
        while not self.stopping.wait(interval_s):
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        """Report children that exited; restart those whose backoff has passed."""
        with self._lock:
            for child in self.children:
                if self.stopping.is_set():
                    return
                if child.restart_at is not None:
                    if now >= child.restart_at:
                        child.restart_at = None
                        child.restarts += 1
                        self._launch(child)
                        print(f"pdserve serve: restarted {child.name}", flush=True)
                    continue
                code = None if child.gone else child.proc.poll()
                if code is not None:
                    self._exited(child, code, now)

    def _exited(self, child: Child, code: int, now: float) -> None:
        child.pump.join(2.0)  # its last lines
        last = "".join(child.tail).rstrip()
        if code == 0 and (child.restart or child.draining):  # it drained and left on purpose
            child.gone = True
            print(f"pdserve serve: {child.name} drained and exited; not restarted", flush=True)
            return
        if child.draining:  # asked to leave before it was ready (SIGTERM during start-up)
            child.gone = True
            print(f"pdserve serve: {child.name} stopped (code {code}); not restarted", flush=True)
            return
        if code == EXIT_CONFIG:
            child.gone, child.refused = True, last
            print(
                f"pdserve serve: {child.name} cannot serve as configured (exit code {code}) and "
                f"is not restarted: it would fail the same way; its last output:\n{last}",
                flush=True,
            )
            return
        if not child.restart:
            child.gone = True
            print(
                f"pdserve serve: {child.name} exited with code {code} and is not restarted; "
                f"its last output:\n{last}",
                flush=True,
            )
            return
        child.crashes.append(now)
        delay = self.policy.delay(child.crashes, now)
        child.restart_at = now + delay
        recent = self.policy.recent(child.crashes, now)
        print(
            f"pdserve serve: {child.name} exited with code {code} ({recent} exits in the last "
            f"{self.policy.window_s:g} s); restarting it in {delay:g} s; its last output:\n{last}",
            flush=True,
        )

    def drain(self, name: str) -> None:
        """Ask worker `name` to drain and leave (SIGTERM: it finishes what it holds, then
        exits 0); it is not restarted, whatever its exit."""
        with self._lock:
            for child in self.children:
                if child.name == name and not child.gone:
                    child.draining = True
                    if child.restart_at is not None:  # waiting to be restarted: just drop it
                        child.restart_at, child.gone = None, True
                    elif child.proc.poll() is None:
                        child.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every child (no restart after this): SIGTERM, then SIGKILL at `timeout_s`."""
        self.stopping.set()
        with self._lock:
            procs = [c.proc for c in self.children]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
