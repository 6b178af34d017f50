"""`pdserve serve --launcher ray`: every prefill and decode worker is a Ray actor, placed by Ray
(resources per pool, node labels `pdserve/role=prefill|decode`) and restarted by Ray when its
process dies. The router stays in the `serve` process; the actors run the same worker code as
`pdserve worker` (engine loop, ZeroMQ control to the router, KV straight between actors over
tcp or nixl: nothing moves through Ray's object store) and register with the router as any
worker does, so the router learns their addresses from them.

A tensor-parallel worker (`--prefill-tp`/`--decode-tp` N) gets a placement group of N bundles,
STRICT_PACK (one node: its ranks share host memory for the KV connectors), each bundle 1/N of the
pool's resources; the actor (rank 0) runs in bundle 0 and starts its other ranks as processes on
that node, whose cores the other bundles hold for them. The group is removed with the worker.

`RayWorkers` has the interface of the local launcher's `WorkerProcs` that `serve` uses; the
actor itself, which runs in Ray's worker process, is `launch/ray_actor.py`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from pdserve import envs
from pdserve.launch.ray_actor import WorkerActor

log = logging.getLogger("pdserve.launch")
ROLE_LABEL = "pdserve/role"
INSTALL_HINT = (
    "--launcher ray needs Ray: pip install 'pdserve[ray]' (ray==2.60.0), or use the default "
    "--launcher local"
)
# what the actors inherit from `serve`'s environment (Ray starts them from its own)
PASSED_ENV = ("PDSERVE_", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY", "HF_", "OTEL_",
              "MC_LOG_LEVEL")  # fmt: skip
PLACEMENT_WARNING_S = 20.0  # a worker Ray has not started by then is reported with its needs


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise SystemExit(f"pdserve serve: error: {INSTALL_HINT}") from exc
    return ray


def parse_resources(text: str | None, flag: str) -> dict[str, float] | None:
    """A Ray resource dict from JSON (`{"CPU": 1, "GPU": 1}`), checked; None: the default."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not JSON ({exc.msg}): give e.g. '{{\"CPU\": 1}}'") from exc
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and v >= 0 for k, v in value.items()
    ):
        raise ValueError(f"{flag}: expected a JSON object of resource amounts, got {text!r}")
    return {k: float(v) for k, v in value.items()}


class RayWorkers:
    """The workers of `pdserve serve --launcher ray`, one actor each."""

    # a worker that failed before it ever served keeps its error (Ray would not fix it)
    start_failures_are_final = True

    def __init__(
        self,
        address: str | None,
        resources: dict[str, dict[str, float] | None],
        public: bool,
        restart: bool = True,
    ) -> None:
        self.ray = ray = import_ray()
        env = envs.for_workers(PASSED_ENV)
        options = {"include_dashboard": False, "log_to_driver": True,
                   "runtime_env": {"env_vars": env}}  # fmt: skip
        if address:
            ray.init(address=address, **options)
        else:  # a local cluster of this machine's cores, as ray.init() starts one
            ray.init(num_cpus=len(os.sched_getaffinity(0)), **options)
        self.started_cluster = not address
        default = {"CPU": 1.0, **({"GPU": 1.0} if ray.cluster_resources().get("GPU") else {})}
        self.resources = {role: want or default for role, want in resources.items()}
        self.resources["both"] = self.resources["decode"]
        self.public, self.restart = public, restart
        self.roles = {n["Labels"].get(ROLE_LABEL) for n in ray.nodes() if n["Alive"]} - {None}
        self.actor_class = ray.remote(WorkerActor)
        self.actors: dict[str, object] = {}
        self.groups: dict[str, object] = {}  # worker -> the placement group of its TP ranks
        self.info_refs: dict[str, object] = {}
        self.pending: dict[str, tuple[float, str]] = {}  # not yet started: since, what it needs
        self.draining: set[str] = set()  # asked to drain and leave (scale-down)
        self.unfixable: dict[str, str] = {}  # worker -> the error no restart can fix
        self.stopping = threading.Event()

    def start(
        self, worker_id, role, cpus, router, engine_argv, transport, tp: int = 1, stages: int = 1
    ) -> None:
        """Like `WorkerProcs.start` (`cpus` is not used: Ray places by resources); a worker of
        `tp` > 1 processes (ranks, or `stages` pipeline stages) runs in a placement group of
        its own (`_group`)."""
        want = dict(self.resources[role])
        num_cpus, num_gpus = want.pop("CPU", 1.0), want.pop("GPU", 0.0)
        argv = ["--role", role, "--router", router, "--worker-id", worker_id,
                "--kv-transport", transport, "--threads", str(max(1, int(num_cpus))),
                *engine_argv]  # fmt: skip
        options = {
            "num_cpus": num_cpus,
            "num_gpus": num_gpus,
            "resources": want or None,
            "max_restarts": -1 if self.restart else 0,
            "max_concurrency": 2,  # `info` answers while the worker thread runs
            "name": f"pdserve-{worker_id}-{os.getpid()}",
        }
        labelled = role in self.roles  # some node is labelled for this pool: only those take it
        if tp > 1:
            options.update(
                self._group(worker_id, tp, num_cpus, num_gpus, want, role, labelled, stages > 1)
            )
        elif labelled:
            options["label_selector"] = {ROLE_LABEL: role}
        actor = self.actor_class.options(**options).remote(argv, self.public)
        self.actors[worker_id] = actor
        self.info_refs[worker_id] = actor.info.remote()
        label = f" on a node labelled {ROLE_LABEL}={role}" if labelled else ""
        group = f" in {tp} bundles {'packed' if stages > 1 else 'on one node'}" if tp > 1 else ""
        self.pending[worker_id] = (time.monotonic(), f"{dict(self.resources[role])}{group}{label}")

    def _group(self, worker_id, tp, num_cpus, num_gpus, custom, role, labelled, span) -> dict:
        """A placement group of `tp` bundles, each 1/tp of the worker's resources (custom ones:
        bundle 0, the actor's), on one node (STRICT_PACK: tensor-parallel ranks share host
        memory), or with `span` (a pipeline's stages: they exchange only activations and push
        their own KV) packed, on as few nodes as hold them (PACK); the actor's options that
        put it in bundle 0."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": num_cpus / tp, **({"GPU": num_gpus / tp} if num_gpus else {})}
        bundles = [{**bundle, **custom}] + [dict(bundle) for _ in range(tp - 1)]
        old = self.groups.pop(worker_id, None)
        if old is not None:  # a worker started again under its id
            self.ray.util.remove_placement_group(old)
        group = self.groups[worker_id] = placement_group(
            [{k: v for k, v in b.items() if v} or {"CPU": 0.001} for b in bundles],
            strategy="PACK" if span else "STRICT_PACK",
            name=f"pdserve-{worker_id}-{os.getpid()}",
            bundle_label_selector=[{ROLE_LABEL: role}] * tp if labelled else None,
        )
        return {
            "num_cpus": bundle["CPU"],
            "num_gpus": bundle.get("GPU", 0.0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, 0),
        }

    def start_store(self, *_args) -> str:
        raise ValueError(
            "--kv-store is not started by --launcher ray: run `pdserve store` on a host and "
            "give its endpoint with --kv-store-endpoint"
        )

    def info(self, worker_id: str, timeout_s: float = 10.0) -> dict:
        return self.ray.get(self.actors[worker_id].info.remote(), timeout=timeout_s)

    def failed(self) -> tuple[str, str] | None:
        """(worker id, why) of a worker that failed before it served, else None."""
        for wid, ref in list(self.info_refs.items()):
            ready, _ = self.ray.wait([ref], timeout=0)
            if not ready:
                since, needs = self.pending.get(wid, (None, ""))
                if since is not None and time.monotonic() - since > PLACEMENT_WARNING_S:
                    del self.pending[wid]
                    print(f"pdserve serve: Ray has not started worker {wid} after "
                          f"{PLACEMENT_WARNING_S:g} s; it needs {needs}: see `ray status` for "
                          "what the cluster has free", flush=True)  # fmt: skip
                continue
            self.pending.pop(wid, None)
            try:
                error = self.ray.get(ref)["error"]
            except self.ray.exceptions.ActorUnavailableError:
                error = None  # its process died and Ray is restarting it: not the worker's fault
            except self.ray.exceptions.RayError as exc:  # gone for good
                return wid, str(exc)
            if error:
                return wid, error
            self.info_refs[wid] = self.actors[wid].info.remote()  # ask again next time
        return None

    def refused(self) -> tuple[str, str] | None:
        """(worker id, error) of a worker that cannot serve as configured (`WorkerProcs`)."""
        return next(iter(self.unfixable.items()), None)

    def drain(self, worker_id: str) -> None:
        """Have the worker drain and leave; its actor is removed once it has (`supervise`)."""
        actor = self.actors.get(worker_id)
        if actor is not None:
            self.draining.add(worker_id)
            actor.drain.remote()

    def supervise(self, interval_s: float = 0.5) -> threading.Thread:
        """Ray restarts dead actors; report each restart (a new pid). An actor whose worker
        drained and left is removed."""

        def watch() -> None:
            pids: dict[str, int] = {}
            while not self.stopping.wait(interval_s * (1 if self.draining else 4)):
                for wid, actor in list(self.actors.items()):
                    try:
                        info = self.ray.get(actor.info.remote(), timeout=5)
                    except self.ray.exceptions.RayError:
                        continue  # dead or restarting: Ray handles it
                    pid = info["pid"]
                    if info["refused"] and wid not in self.unfixable:
                        self.unfixable[wid] = info["error"]
                        print(f"pdserve serve: worker {wid} cannot serve as configured and is "
                              f"not restarted:\n{info['error']}", flush=True)  # fmt: skip
                    if info["done"]:
                        self.remove(wid)
                        print(f"pdserve serve: worker {wid} drained and left; its actor is "
                              "removed", flush=True)  # fmt: skip
                        continue
                    if wid in pids and pids[wid] != pid:
                        print(f"pdserve serve: worker {wid} was restarted by Ray (pid {pid})",
                              flush=True)  # fmt: skip
                    pids[wid] = pid

        thread = threading.Thread(target=watch, name="ray-supervise", daemon=True)
        thread.start()
        return thread

    def remove(self, worker_id: str) -> None:
        actor = self.actors.pop(worker_id, None)
        self.info_refs.pop(worker_id, None)
        self.draining.discard(worker_id)
        if actor is not None:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001  (already gone)
                pass
        self._remove_group(worker_id)

    def _remove_group(self, worker_id: str) -> None:
        group = self.groups.pop(worker_id, None)
        if group is not None:
            try:
                self.ray.util.remove_placement_group(group)
            except Exception:  # noqa: BLE001  (the cluster is gone)
                pass

    def forward_output(self) -> None:
        pass  # Ray forwards the actors' output itself (log_to_driver)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stopping.set()
        for actor in self.actors.values():
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001  (already gone)
                pass
        self.actors.clear()
        for worker_id in list(self.groups):
            self._remove_group(worker_id)
        if self.started_cluster:
            self.ray.shutdown()
