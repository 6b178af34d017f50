"""The ranks of a tensor-parallel engine as processes: rank 0 starts ranks 1 .. N-1 (`python -m
pdserve.engine.tp`, each pinned to its share of rank 0's cores, dying with it) and sends them
what they build their part from (`start_group`); each of them then runs every step rank 0
sends (`follow`) until told to stop."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from dataclasses import replace
from typing import NamedTuple

import torch

from pdserve.engine.pp.stages import StagePlace, stage_layers
from pdserve.engine.tp.codec import Start, Step
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.shard import TPShard
from pdserve.subprocs import die_with_parent, free_port, split_cores

log = logging.getLogger("pdserve.engine.tp")


def start_group(config, files, max_model_len: int, stage: int = 0) -> TPGroup:
    """Rank 0: start ranks 1 .. N-1, join them, and send them what they build their part from
    (`files`: a pipeline stage's part, for the ranks of `stage`)."""
    from pdserve.engine.model_runner import resolve_device

    size, ep = config.tensor_parallel_size, config.expert_parallel_size
    TPShard(0, size, ep).check(files.config)
    if resolve_device(config.device).type != "cpu":
        raise ValueError(
            "--tensor-parallel-size > 1 runs on CPU ranks (gloo) for now; on a GPU use "
            "--tensor-parallel-size 1 (one GPU per worker)"
        )
    spawned = spawn_ranks("pdserve.engine.tp", size, config.num_threads)
    group = TPGroup(TPShard(0, size, ep), spawned.port, spawned.procs)
    group.restore = spawned.pin_self()
    path = str(files.path) if files.path is not None else None
    group.broadcast(
        Start(config, files.config, files.weights, files.fingerprint, path, max_model_len, stage)
    )
    return group


class Spawned(NamedTuple):
    """The other ranks of a group, started (`spawn_ranks`)."""

    port: int  # rank 0's rendezvous
    threads: int  # torch threads per rank
    cores: list[list[int]]  # each rank's cores
    procs: list[subprocess.Popen]

    def pin_self(self) -> tuple[set[int], int]:
        """Pin this process (rank 0) to its share; returns its cores and threads before."""
        before = os.sched_getaffinity(0), torch.get_num_threads()
        os.sched_setaffinity(0, self.cores[0])
        torch.set_num_threads(self.threads)
        return before


def spawn_ranks(module: str, size: int, num_threads: int | None) -> Spawned:
    """Rank 0: start ranks 1 .. size-1 as `python -m module` (its `main`: `rank_main`), each
    pinned to its share of this process's cores with its share of the threads, dying with it.
    Tensor-parallel ranks and pipeline stages alike."""
    port = free_port()
    threads = max(1, (num_threads or torch.get_num_threads()) // size)
    cores = split_cores(sorted(os.sched_getaffinity(0)), [1] * size)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                "--rank",
                str(r),
                "--size",
                str(size),
                "--port",
                str(port),
                "--threads",
                str(threads),
                "--cores",
                ",".join(map(str, cores[r])),
            ],
            preexec_fn=die_with_parent,
        )  # fmt: skip
        for r in range(1, size)
    ]
    return Spawned(port, threads, cores, procs)


def follow(rank: int, size: int, port: int, threads: int) -> None:
    """Ranks 1 .. N-1: build this rank's part of the model, then run every step rank 0 sends
    until it sends None."""
    from pdserve.engine.model_runner import ModelRunner

    torch.set_num_threads(threads)
    group = TPGroup(TPShard(rank, size), port)
    start = group.broadcast(None, Start)
    group.shard = replace(group.shard, ep=start.config.expert_parallel_size)
    config = replace(start.config, num_threads=threads)
    place = None  # a pipeline stage's rank: its stage's layers
    if config.pipeline_parallel_size > 1:
        layers = stage_layers(start.model.num_layers, config.pipeline_parallel_size,
                              config.pp_layer_partition)  # fmt: skip
        place = StagePlace(start.stage, layers)
    runner = ModelRunner(config, start.files(), start.max_model_len, group, place)
    del start
    try:
        while (step := group.broadcast(None, Step | None)) is not None:
            if step.hidden is not None:  # a later stage's: its layers over the hidden states
                runner.run_layers(step)
            else:
                runner.forward(step.input_ids, step.positions, step.meta())
    except RuntimeError:  # rank 0 went away without saying so (it exited, or was killed)
        log.warning("tensor-parallel rank %d: rank 0 is gone; exiting", rank)


def main() -> None:
    rank_main("python -m pdserve.engine.tp", "one rank of a tensor-parallel engine", follow)


def rank_main(prog: str, what: str, follow_fn) -> None:
    """The command line of a rank that `spawn_ranks` started: pin it, then `follow_fn(rank,
    size, port, threads)`."""
    p = argparse.ArgumentParser(prog=prog, description=f"{what} (started by rank 0; not run by "
                                "hand)")  # fmt: skip
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cores", default="", help="CPU cores to pin this rank to, e.g. 2,3")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if os.getppid() == 1:  # rank 0 died before we started
        return
    if args.cores:
        os.sched_setaffinity(0, [int(c) for c in args.cores.split(",")])
    follow_fn(args.rank, args.size, args.port, args.threads)
