"""Tensor parallelism: one engine as N ranks (`--tensor-parallel-size N`), Megatron-style.

Each rank holds a slice of every layer: its share of the query heads and of the KV heads (q/k/v
split by rows, the output projection by columns), and of the MLP's intermediate columns
(gate/up by rows, down by columns); one all-reduce after the attention's output projection and
one after the MLP add the ranks' partial sums. Embeddings, norms and the LM head are whole on
every rank. Each rank's KV cache holds its own KV heads, at the same block ids as rank 0's.

Rank 0 is the engine: its scheduler decides every step, and it sends the step's inputs (token
ids, positions, attention metadata with the block tables) to the other ranks (`broadcast_step`),
which run the same forward pass (`follow`) and sample nothing. At start rank 0 starts the other
ranks as processes (`python -m pdserve.engine.tp`), which die with it, and sends them the engine
config and the model's weights (so a model built in memory, as tests do, needs no file).
Collectives use gloo on CPU.

KV heads that do not divide by N are replicated when N is a multiple of their count (as vLLM
does: ranks r*k .. r*k+k-1 share head r); other splits are refused with the reason.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from pdserve.subprocs import die_with_parent, free_port

log = logging.getLogger(__name__)
INIT_TIMEOUT_S = 300.0  # for the other ranks to start, load and join


@dataclass(frozen=True)
class TPShard:
    """Which slice of the model rank `rank` of `size` holds."""

    rank: int = 0
    size: int = 1

    def check(self, cfg) -> None:
        """ValueError naming what does not split, and the sizes that would."""
        n, heads, kv, ffn = self.size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        ok = [
            k
            for k in range(1, heads + 1)
            if heads % k == 0 and ffn % k == 0 and (kv % k == 0 or k % kv == 0)
        ]
        if n not in ok:
            raise ValueError(
                f"--tensor-parallel-size {n} does not split this model ({heads} query heads, "
                f"{kv} KV heads, MLP width {ffn}): the query heads and the MLP width must divide "
                f"by it, and the KV heads divide by it or it by them (then each is replicated); "
                f"sizes that work: {', '.join(map(str, ok))}"
            )

    def local_heads(self, cfg) -> tuple[int, int]:
        """(query heads, KV heads) on this rank."""
        return cfg.num_heads // self.size, max(1, cfg.num_kv_heads // self.size)

    def kv_heads(self, cfg) -> range:
        """The model's KV heads this rank holds."""
        kv = cfg.num_kv_heads
        if kv % self.size == 0:
            per = kv // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        head = self.rank // (self.size // kv)  # replicated: size/kv ranks share one head
        return range(head, head + 1)

    def weights(self, cfg, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This rank's slices of the layers' weights (others unchanged)."""
        if self.size == 1:
            return weights
        d, r, n = cfg.head_dim, self.rank, self.size
        q_heads = cfg.num_heads // n
        q = slice(r * q_heads * d, (r + 1) * q_heads * d)
        kv_heads = self.kv_heads(cfg)
        kv = slice(kv_heads.start * d, kv_heads.stop * d)
        f = cfg.intermediate_size // n
        ffn = slice(r * f, (r + 1) * f)
        rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
                "mlp.gate_proj": ffn, "mlp.up_proj": ffn}  # fmt: skip
        cols = {"self_attn.o_proj": q, "mlp.down_proj": ffn}
        out = dict(weights)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            for name, s in rows.items():
                out[p + name + ".weight"] = weights[p + name + ".weight"][s]
            for name, s in cols.items():
                out[p + name + ".weight"] = np.ascontiguousarray(
                    weights[p + name + ".weight"][:, s]
                )
        return out


class TPGroup:
    """This process's place in the group and its collectives."""

    def __init__(self, shard: TPShard, procs: list[subprocess.Popen] | None = None) -> None:
        self.shard, self.procs = shard, procs or []

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (in float32: gloo and the sum order alike)."""
        if self.size == 1:
            return x
        total = x.float()
        dist.all_reduce(total)
        return total.to(x.dtype)

    def broadcast(self, obj):
        """Rank 0 sends `obj` to every rank; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        """Rank 0: the other ranks stop (they leave their loop and exit)."""
        if self.shard.rank == 0 and self.size > 1 and dist.is_initialized():
            try:
                self.broadcast(None)
            except RuntimeError:
                pass  # a rank is gone already
            dist.destroy_process_group()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def start_group(config, files, max_model_len: int) -> TPGroup:
    """Rank 0: start ranks 1 .. N-1, join them, and send them what they build their part from."""
    from pdserve.engine.model_runner import resolve_device

    size = config.tensor_parallel_size
    TPShard(0, size).check(files.config)
    if resolve_device(config.device).type != "cpu":
        raise ValueError(
            "--tensor-parallel-size > 1 runs on CPU ranks (gloo) for now; on a GPU use "
            "--tensor-parallel-size 1 (one GPU per worker)"
        )
    port = free_port()
    threads = max(1, (config.num_threads or torch.get_num_threads()) // size)
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
            ],
            preexec_fn=die_with_parent,
        )  # fmt: skip
        for r in range(1, size)
    ]
    _join(0, size, port)
    group = TPGroup(TPShard(0, size), procs)
    group.broadcast((config, files, max_model_len))
    return group


def _join(rank: int, size: int, port: int) -> None:
    from datetime import timedelta

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=timedelta(seconds=INIT_TIMEOUT_S),
    )  # fmt: skip


def follow(rank: int, size: int, port: int, threads: int) -> None:
    """Ranks 1 .. N-1: build this rank's part of the model, then run every step rank 0 sends
    until it sends None."""
    from pdserve.engine.model_runner import ModelRunner

    torch.set_num_threads(threads)
    _join(rank, size, port)
    group = TPGroup(TPShard(rank, size))
    config, files, max_model_len = group.broadcast(None)
    runner = ModelRunner(replace(config, num_threads=threads), files, max_model_len, group)
    del files
    try:
        while (inputs := group.broadcast(None)) is not None:
            runner.forward(*inputs)
    except RuntimeError:  # rank 0 went away without saying so (it exited, or was killed)
        log.warning("tensor-parallel rank %d: rank 0 is gone; exiting", rank)
        return
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description="one rank of a tensor-parallel engine (started by "
                                "rank 0; not run by hand)")  # fmt: skip
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if os.getppid() == 1:  # rank 0 died before we started
        return
    follow(args.rank, args.size, args.port, args.threads)


if __name__ == "__main__":
    main()
