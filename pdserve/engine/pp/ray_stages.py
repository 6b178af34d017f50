"""A pipeline's later stages as Ray actors, when its stage 0 is a worker Ray placed
(`serve --launcher ray`): the launcher gives the worker a placement group of one bundle per
stage, PACK (stages exchange only activations and push their own KV, so they may span nodes);
stage 0 runs in bundle 0 and starts stage s as an actor in bundle s (`spawn_ray_stages`), which
joins stage 0's rendezvous at stage 0's node address from its own node's. The stages' caches
are each their own (no shared memory between hosts), so the KV store link, which moves every
layer from stage 0, is refused with such a pipeline (`serving/build.py`). An actor dies with
the worker that started it (Ray's ownership); one that dies fails the engine's next exchange
(`StageLost`), as a local stage's exit does."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from pdserve.engine.pp.pipe import PPGroup
from pdserve.subprocs import free_port

NAMESPACE = "pdserve"


def ray_placement(size: int):
    """The placement group this process runs in when it is a Ray actor whose group has a
    bundle for each of `size` stages; else None (the stages are then this host's processes)."""
    if "ray" not in sys.modules:  # not a Ray worker process: nothing imported Ray
        return None
    import ray

    if not ray.is_initialized():
        return None
    group = ray.util.get_current_placement_group()
    return group if group is not None and len(group.bundle_specs) >= size else None


class StageActor:
    """One later stage of a pipeline, in a Ray worker process: `follow` is the stage's loop
    (`engine/pp/stage.py`'s, passed by reference)."""

    def run(self, follow, stage: int, size: int, port: int, threads: int, master: str) -> None:
        import ray

        follow(stage, size, port, threads, master=master,
               address=ray.util.get_node_ip_address(), shared=False)  # fmt: skip

    def node_id(self) -> str:
        """The Ray node it runs on (answered while `run` runs: two calls at once)."""
        import ray

        return ray.get_runtime_context().get_node_id()


def stage_actor_name(stage: int, actor_id: str, pid: int) -> str:
    """Stage `stage`'s actor's name (in Ray namespace NAMESPACE), of the pipeline whose stage
    0 is actor `actor_id` in process `pid` (a worker's `ray_actor_id` and `pid` in /health):
    `ray list actors` shows it. A worker actor Ray restarts keeps its id but not
    its process, so its new stages do not take the names of its old ones, which Ray may not
    have reaped yet (creating a named actor whose name is taken fails)."""
    return f"pdserve-stage-{stage}-of-{actor_id}-{pid}"


class RayStage:
    """A stage actor as stage 0 watches and reaps a stage process (`subprocess.Popen`'s
    `poll`, `returncode`, `wait`, `kill`): it has exited once its `run` has returned or
    failed (the actor died)."""

    def __init__(self, actor, done) -> None:
        self.actor, self.done = actor, done
        self.returncode: int | None = None

    def poll(self) -> int | None:
        import ray

        if self.returncode is None:
            ready, _ = ray.wait([self.done], timeout=0)
            if ready:
                try:
                    ray.get(self.done)
                    self.returncode = 0
                except Exception:  # noqa: BLE001  (the actor died, or `run` raised)
                    self.returncode = 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import ray

        ray.wait([self.done], timeout=timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired("ray stage actor", timeout or 0)
        return self.returncode

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


def spawn_ray_stages(group, layers: list[range], num_threads: int | None, follow) -> PPGroup:
    """Stage 0 (this Ray actor, in bundle 0 of `group`): start stage s as an actor in bundle
    s with that bundle's resources, running `follow`, and join them (each gets its share of
    the threads)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    size = len(layers)
    address = ray.util.get_node_ip_address()
    port = free_port()
    threads = max(1, (num_threads or torch.get_num_threads()) // size)
    torch.set_num_threads(threads)
    actor_class = ray.remote(StageActor)
    me = ray.get_runtime_context().get_actor_id()
    procs = []
    for s in range(1, size):
        bundle = group.bundle_specs[s]
        actor = actor_class.options(
            num_cpus=bundle.get("CPU", 0.0),
            num_gpus=bundle.get("GPU", 0.0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, s),
            max_restarts=0,
            max_concurrency=2,
            name=stage_actor_name(s, me, os.getpid()),
            namespace=NAMESPACE,
        ).remote()
        procs.append(RayStage(actor, actor.run.remote(follow, s, size, port, threads, address)))
    return PPGroup(0, layers, port, procs, master=address, address=address, shared=False)
