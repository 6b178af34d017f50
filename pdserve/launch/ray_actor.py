"""The Ray actor of `pdserve serve --launcher ray` (`launch/ray_launcher.py` places and
supervises it): one worker, run as `pdserve worker` runs, in a Ray worker process."""

from __future__ import annotations

import os
import threading
import time
import traceback
import warnings

from pdserve.subprocs import cannot_restart

RESTART_PAUSE_S = 2.0  # a worker that fails after it served waits this long before Ray restarts it


class WorkerActor:
    """One worker in a Ray actor: `__init__` starts the worker's loop on a thread and returns
    (Ray counts the actor alive once it does). If the loop fails after the worker has served,
    the process exits so that Ray restarts the actor (`max_restarts`), which registers again
    under the same worker id; a failure before that (a bad flag, a missing model), or one that
    no restart can fix (refused by the router for its KV layout), is kept for `info`, so
    `serve` reports it instead of Ray restarting it forever."""

    def __init__(self, argv: list[str], public: bool) -> None:
        import ray

        ctx = ray.get_runtime_context()
        self.placement = (
            ("ray_node_id", ctx.get_node_id()),
            ("ray_actor_id", ctx.get_actor_id()),
        )
        if public:  # other hosts must reach this worker's KV receiver
            argv = [*argv, "--kv-host", ray.util.get_node_ip_address()]
        with warnings.catch_warnings():  # Ray's own use of a deprecated API inside it
            warnings.simplefilter("ignore", DeprecationWarning)
            self.restarted = ctx.was_current_actor_reconstructed
        self.error: str | None = None
        self.refused = False  # it cannot serve as configured (`subprocs.cannot_restart`)
        self.worker = None
        self.done = False  # the worker drained and left
        self.leave = False  # asked to (`drain`)
        self.thread = threading.Thread(target=self._run, args=(argv,), daemon=True)
        self.thread.start()

    def _run(self, argv: list[str]) -> None:
        from pdserve.cli import build_parser
        from pdserve.launch.local import worker_config
        from pdserve.serving.build import build_worker

        worker = None
        try:
            args = build_parser().parse_args(["worker", *argv])
            worker = self.worker = build_worker(worker_config(args, placement=self.placement))
            worker.drain_requested = self.leave  # asked to leave while it was starting
            worker.run()
            if worker.refused:  # a router refused it on registering again: no restart helps
                self.error, self.refused = worker.refused, True
            else:
                self.done = True
        except BaseException as exc:  # noqa: BLE001  (SystemExit from argparse too)
            self.error = traceback.format_exc()
            print(self.error, flush=True)
            served = worker is not None and worker.registered
            if cannot_restart(exc) and not served:
                self.refused = True  # kept for `info`: Ray restarting it would not help
            elif self.restarted or served:
                time.sleep(RESTART_PAUSE_S)
                os._exit(1)  # Ray restarts the actor

    def info(self) -> dict:
        return {"pid": os.getpid(), "error": self.error, "done": self.done,
                "refused": self.refused, **dict(self.placement)}  # fmt: skip

    def drain(self) -> None:
        """Drain and leave, as `pdserve worker` on SIGTERM (`RayWorkers.drain`)."""
        self.leave = True
        if self.worker is not None:
            self.worker.drain_requested = True
