"""The local launcher: worker and KV store subprocesses pinned to cores, uvicorn for the router."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve import envs

log = logging.getLogger("pdserve.serve")


def pin_cpus(cpus: str | None) -> int | None:
    """Pin this process to the listed cores ("0,1" or "2-3"); returns how many."""
    if not cpus:
        return None
    ids: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        ids.update(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, ids)
    return len(ids)


def run_worker(config) -> int:
    from pdserve.serving.worker import Worker

    worker = Worker(config)
    signal.signal(signal.SIGTERM, lambda *_: setattr(worker, "running", False))
    try:
        worker.run()
    except RuntimeError as exc:
        print(f"pdserve worker: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


@dataclass(frozen=True)
class ServePlan:
    """Which workers `pdserve serve` starts, each as (role, cpus)."""

    workers: tuple[tuple[str, str], ...]

    @classmethod
    def make(
        cls, mode: str, prefill: int, decode: int, colocated: int, cores: list[int]
    ) -> ServePlan:
        if mode == "colocated":
            groups = _split(cores, colocated)
            return cls(tuple(("both", g) for g in groups))
        if prefill < 0 or decode < 1:
            raise ValueError("disaggregated serving needs --decode >= 1 and --prefill >= 0")
        groups = _split(cores, prefill + decode)
        return cls(
            tuple(("prefill", g) for g in groups[:prefill])
            + tuple(("decode", g) for g in groups[prefill:])
        )


def visible_gpus() -> int:
    """How many CUDA GPUs a worker would see, found without importing torch (the router stays
    light): `CUDA_VISIBLE_DEVICES` when set, else the NVIDIA driver's entries in /proc."""
    ids = envs.cuda_visible_devices()
    if ids is not None:
        return 0 if not ids or ids[0] == "-1" else len(ids)
    gpus = Path("/proc/driver/nvidia/gpus")
    return sum(1 for _ in gpus.iterdir()) if gpus.is_dir() else 0


def gpu_per_worker(device: str, workers: int, gpus: int) -> list[str | None]:
    """Each worker's `--device`: with `device` auto or cuda and several GPUs, a GPU each in turn
    (prefill workers come first, so one prefill and one decode worker get GPUs 0 and 1); else
    None, the `device` every worker is given."""
    if device not in ("auto", "cuda") or gpus < 2:
        return [None] * workers
    return [f"cuda:{i % gpus}" for i in range(workers)]


def _split(cores: list[int], n: int) -> list[str]:
    """n groups of cores; with fewer cores than workers, workers share cores round-robin."""
    if n < 1:
        raise ValueError("need at least one worker")
    if len(cores) >= n:
        size = len(cores) // n
        return [",".join(map(str, cores[i * size : (i + 1) * size])) for i in range(n)]
    return [str(cores[i % len(cores)]) for i in range(n)]


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker when `pdserve serve` dies, however it dies (even kill -9),
    so no orphaned worker keeps a core busy."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class WorkerProcs:
    """The worker subprocesses of `pdserve serve`; stopped together."""

    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(
        self,
        worker_id: str,
        role: str,
        cpus: str,
        router: str,
        engine_argv: list[str],
        transport: str,
    ):
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "worker",
            "--role",
            role,
            "--router",
            router,
            "--worker-id",
            worker_id,
            "--cpus",
            cpus,
            "--kv-transport",
            transport,
            *engine_argv,
        ]
        return self._spawn(worker_id, cmd)

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.procs.append((name, proc))
        return proc

    def start_store(
        self, store_dir: str | None, dram_gb: float, ssd_gb: float, transport: str = "tcp"
    ) -> str:
        """Start `pdserve store` (block bytes over `transport`: tcp or nixl) and return its
        endpoint (tcp:// or nixl://) once it listens."""
        import tempfile

        store_dir = store_dir or tempfile.mkdtemp(prefix="pdserve-store-")
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "store",
            "--port",
            "0",
            "--store-dir",
            store_dir,
            "--dram-gb",
            str(dram_gb),
            "--ssd-gb",
            str(ssd_gb),
            "--transport",
            transport,
        ]
        proc = self._spawn("store", cmd)
        for line in proc.stdout:
            if "listening on " in line:
                return line.split("listening on ", 1)[1].split()[0]
        raise RuntimeError(f"the KV store did not start: {proc.stdout.read()[-2000:]}")

    def failed(self) -> tuple[str, str] | None:
        """(worker id, its output) of the first worker that exited."""
        for wid, proc in self.procs:
            if proc.poll() is not None:
                out = proc.stdout.read() if proc.stdout else ""
                return wid, out[-3000:]
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for _, proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def wait_ready(
    core, procs: WorkerProcs, n_prefill: int, n_decode: int, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await core.wait_for_workers(n_prefill, n_decode, 0.2):
        dead = procs.failed()
        if dead:
            raise RuntimeError(f"worker {dead[0]} failed to start:\n{dead[1]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers did not register within {timeout_s:.0f}s")


def drain_worker_output(procs: WorkerProcs) -> None:
    """Forward worker logs to our stderr so pipes never fill up."""
    import threading

    def pump(wid, proc):
        for line in proc.stdout:
            sys.stderr.write(f"[{wid}] {line}")

    for wid, proc in procs.procs:
        threading.Thread(target=pump, args=(wid, proc), daemon=True).start()


def serve_forever(app, host: str, port: int, on_ready=None, on_stop=None) -> int:
    """Runs uvicorn with the router app; on_ready(port) after startup; on_stop on exit."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)

    async def main():
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                return task.result()
            await asyncio.sleep(0.05)
        bound = server.servers[0].sockets[0].getsockname()[1]
        if on_ready:
            await on_ready(bound)
        await task

    try:
        asyncio.run(main())
    finally:
        if on_stop:
            on_stop()
    return 0
