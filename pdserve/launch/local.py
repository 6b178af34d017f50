"""The local launcher: cores and GPUs per worker, the serve plan, waiting for the workers to
register, running one worker process, and uvicorn for the router (the processes: `procs.py`)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve import envs
from pdserve.aio import fast_event_loop
from pdserve.config import WORKER_CHUNK_SIZE
from pdserve.subprocs import EXIT_CONFIG, WorkerRefused, cannot_restart, split_cores

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


def worker_config(args, threads: int | None = None, placement: tuple = ()):
    """The WorkerConfig of `pdserve worker`'s flags (the Ray launcher's actors use it too)."""
    from dataclasses import replace

    from pdserve.engine.cli import engine_config_from_args
    from pdserve.serving.worker_config import WorkerConfig

    chunk = WORKER_CHUNK_SIZE.get(args.role) if args.chunk_size is None else args.chunk_size
    engine = engine_config_from_args(args, role=args.role, chunk_size=chunk or None)
    if threads or args.threads:
        engine = replace(engine, num_threads=threads or args.threads)
    return WorkerConfig(
        kv_store=args.kv_store,
        engine=engine,
        routers=tuple(args.router),
        worker_id=args.worker_id or f"{args.role}-{os.getpid()}",
        kv_transport=args.kv_transport,
        kv_host=args.kv_host,
        router_timeout_s=args.router_timeout_s,
        transfer_timeout_s=args.transfer_timeout_s,
        placement=placement,
        kv_compression=args.kv_compression,
        kv_push=args.kv_push,
        drain_timeout_s=args.drain_timeout_s,
    )


def run_worker(config) -> int:
    """Run one worker until it stops. Its exit status: 0 once it drained or was told to stop;
    `EXIT_CONFIG` when it cannot serve as configured (refused by the router, a wrong setting
    or model: `subprocs.cannot_restart`), so that its launcher does not restart it; 2 for
    another error (no router answered, a failure after it served)."""
    from pdserve.serving.build import build_worker

    # SIGINT stops a worker (KeyboardInterrupt: exit 0) also when this process was started with
    # it ignored, as a non-interactive shell starts its background jobs (`cmd &`; CI runners):
    # Python then sets no handler, and a launcher stopping its workers with SIGINT waited for
    # its SIGKILL fallback
    signal.signal(signal.SIGINT, signal.default_int_handler)
    worker = None
    try:
        worker = build_worker(config)
        signal.signal(signal.SIGTERM, _drain_on_term(worker))
        worker.run()
        if worker.refused:  # a router refused it on registering again: do not loop
            return config_error(WorkerRefused(worker.refused))
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        if cannot_restart(exc) and not (worker is not None and worker.registered):
            return config_error(exc)
        print(f"pdserve worker: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        if worker is not None:
            worker.leave_now()
    return 0


def _drain_on_term(worker):
    def on_term(*_) -> None:  # drain; a second SIGTERM stops at once
        worker.running = worker.running and not worker.drain_requested
        worker.drain_requested = True

    return on_term


def config_error(exc: Exception) -> int:
    """`pdserve worker` given settings it cannot run with: say why, exit `EXIT_CONFIG`."""
    print(f"pdserve worker: error: {exc}", file=sys.stderr, flush=True)
    return EXIT_CONFIG


@dataclass(frozen=True)
class ServePlan:
    """Which workers `pdserve serve` starts, each as (role, cpus). With enough cores, a
    tensor-parallel worker gets as many shares of them as it has ranks (`tp`: size per role)."""

    workers: tuple[tuple[str, str], ...]

    @classmethod
    def make(
        cls, mode: str, prefill: int, decode: int, colocated: int, cores: list[int],
        tp: dict[str, int] | None = None,
    ) -> ServePlan:  # fmt: skip
        tp = tp or {}
        if mode == "colocated":
            groups = _split(cores, [tp.get("both", 1)] * colocated)
            return cls(tuple(("both", g) for g in groups))
        if prefill < 0 or decode < 1:
            raise ValueError("disaggregated serving needs --decode >= 1 and --prefill >= 0")
        weights = [tp.get("prefill", 1)] * prefill + [tp.get("decode", 1)] * decode
        groups = _split(cores, weights)
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


def _split(cores: list[int], weights: list[int]) -> list[str]:
    """Each worker's `--cpus` (`split_cores`)."""
    return [",".join(map(str, group)) for group in split_cores(cores, weights)]


async def wait_ready(core, procs, n_prefill: int, n_decode: int, timeout_s: float) -> None:
    """Wait until the router has every worker of the plan; `core.ready` (GET /health) waits
    for the same. A worker that exits before any has registered fails the start-up (a wrong
    flag, a missing model: restarting would not help); once one has registered, the launcher
    supervises them all, and one that exits is restarted like any failed worker, unless it
    cannot serve as configured (`procs.refused`: its KV layout refused by the router, a wrong
    setting): that fails the start-up too."""
    core.expected = (n_prefill, n_decode)
    deadline = time.monotonic() + timeout_s
    supervising = False
    while not await core.wait_for_workers(n_prefill, n_decode, 0.2):
        if not supervising and core.workers:
            procs.supervise()
            supervising = True
        if (not supervising or procs.start_failures_are_final) and (dead := procs.failed()):
            raise RuntimeError(f"worker {dead[0]} failed to start:\n{dead[1]}")
        if dead := procs.refused():
            raise RuntimeError(f"worker {dead[0]} cannot serve as configured:\n{dead[1]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers did not register within {timeout_s:.0f}s")
    if not supervising:
        procs.supervise()


def serve_forever(app, host: str, port: int, on_ready=None, on_stop=None, drain=None) -> int:
    """Runs uvicorn with the router app; on_ready(port) after startup (returning False: the
    start-up failed, stop with exit status 1); on_stop on exit. With
    `drain` (a coroutine function), SIGTERM first awaits it (the server stops admitting and
    lets what it admitted finish), then stops: exit status 0. SIGINT, or a second SIGTERM,
    stops at once."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)

    async def main():
        loop = asyncio.get_running_loop()
        if drain is not None:
            immediate = server.handle_exit
            draining: list[asyncio.Task | None] = []

            async def drain_then_exit() -> None:
                await drain()
                server.should_exit = True  # no captured signal: uvicorn exits with status 0

            def handle_exit(sig, frame) -> None:
                if sig == signal.SIGTERM and not draining:
                    draining.append(None)  # at once: a second SIGTERM stops immediately
                    loop.call_soon_threadsafe(
                        lambda: draining.append(loop.create_task(drain_then_exit()))
                    )
                else:
                    immediate(sig, frame)

            server.handle_exit = handle_exit  # uvicorn installs it as its signal handler
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                return task.result()
            await asyncio.sleep(0.05)
        bound = server.servers[0].sockets[0].getsockname()[1]
        failed = on_ready is not None and await on_ready(bound) is False
        server.should_exit = server.should_exit or failed
        await task
        return 1 if failed else 0

    try:
        with asyncio.Runner(loop_factory=fast_event_loop()) as runner:  # uvloop
            return runner.run(main()) or 0
    finally:
        if on_stop:
            on_stop()
