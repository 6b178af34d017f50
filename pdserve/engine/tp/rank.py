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

import torch

from pdserve.engine.tp.codec import Start, Step
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.shard import TPShard
from pdserve.subprocs import die_with_parent, free_port, split_cores

log = logging.getLogger("pdserve.engine.tp")


def start_group(config, files, max_model_len: int) -> TPGroup:
    """Rank 0: start ranks 1 .. N-1, join them, and send them what they build their part from."""
    from pdserve.engine.model_runner import resolve_device

    size, ep = config.tensor_parallel_size, config.expert_parallel_size
    TPShard(0, size, ep).check(files.config)
    if resolve_device(config.device).type != "cpu":
        raise ValueError(
            "--tensor-parallel-size > 1 runs on CPU ranks (gloo) for now; on a GPU use "
            "--tensor-parallel-size 1 (one GPU per worker)"
        )
    port = free_port()
    threads = max(1, (config.num_threads or torch.get_num_threads()) // size)
    before = os.sched_getaffinity(0), torch.get_num_threads()
    cores = split_cores(sorted(before[0]), [1] * size)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.engine.tp",
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
    group = TPGroup(TPShard(0, size, ep), port, procs)
    group.restore = before
    os.sched_setaffinity(0, cores[0])
    torch.set_num_threads(threads)
    path = str(files.path) if files.path is not None else None
    group.broadcast(
        Start(config, files.config, files.weights, files.fingerprint, path, max_model_len)
    )
    return group


def follow(rank: int, size: int, port: int, threads: int) -> None:
    """Ranks 1 .. N-1: build this rank's part of the model, then run every step rank 0 sends
    until it sends None."""
    from pdserve.engine.model_runner import ModelRunner

    torch.set_num_threads(threads)
    group = TPGroup(TPShard(rank, size), port)
    start = group.broadcast(None, Start)
    group.shard = replace(group.shard, ep=start.config.expert_parallel_size)
    config = replace(start.config, num_threads=threads)
    runner = ModelRunner(config, start.files(), start.max_model_len, group)
    del start
    try:
        while (step := group.broadcast(None, Step | None)) is not None:
            runner.forward(step.input_ids, step.positions, step.meta())
    except RuntimeError:  # rank 0 went away without saying so (it exited, or was killed)
        log.warning("tensor-parallel rank %d: rank 0 is gone; exiting", rank)


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.engine.tp",
        description="one rank of a tensor-parallel engine (started by rank 0; not run by hand)",
    )
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
    follow(args.rank, args.size, args.port, args.threads)
