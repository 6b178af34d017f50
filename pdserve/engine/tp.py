"""Tensor parallelism: one engine as N ranks (`--tensor-parallel-size N`), Megatron-style.

Each rank holds a slice of every layer: its share of the query heads and of the KV heads (q/k/v
split by rows, the output projection by columns), and of the MLP's intermediate columns
(gate/up by rows, down by columns); one all-reduce after the attention's output projection and
one after the MLP add the ranks' partial sums. Embeddings, norms and the LM head are whole on
every rank. Each rank's KV cache holds its own KV heads, at the same block ids as rank 0's.

Rank 0 is the engine: its scheduler decides every step, and it sends the step's inputs (token
ids, positions, attention metadata with the block tables) to the other ranks (`broadcast`),
which run the same forward pass (`follow`) and sample nothing. At start rank 0 starts the other
ranks as processes (`python -m pdserve.engine.tp`), which die with it, each pinned to its share
of rank 0's cores, and sends them the engine config and the model's weights (so a model built in
memory, as tests do, needs no file). Collectives use gloo on CPU.

The other ranks' KV caches live in shared memory (`shared_caches`: a memfd each, which rank 0
maps through /proc/PID/fd): the worker's KV connectors run in rank 0's process and move every
rank's heads (a prefill group's sender reads them all; a decode group has one receiver per
rank, each writing its rank's cache). Rank 0 pushes a layer once its forward pass is over: the
all-reduce after the layer's MLP has then waited for every rank, so all their KV is written.

KV heads that do not divide by N are replicated when N is a multiple of their count (as vLLM
does: ranks r*k .. r*k+k-1 share head r); other splits are refused with the reason.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from pdserve.config import EngineConfig, ModelConfig
from pdserve.kv_transfer.base import kv_head_range
from pdserve.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan
from pdserve.model.loader import ModelFiles
from pdserve.subprocs import die_with_parent, free_port, split_cores

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
        """The model's KV heads this rank holds (replicated ones: size/kv ranks share one)."""
        return kv_head_range(self.rank, self.size, cfg.num_kv_heads)

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

    def __init__(self, shard: TPShard, port: int, procs: list[subprocess.Popen] | None = None):
        """Join the group's gloo process group (rank 0 hosts its rendezvous at `port`). The
        group is this engine's own, not torch.distributed's default one: a process may hold
        several engines (tests do)."""
        self.shard, self.procs = shard, procs or []
        self.restore: tuple[set[int], int] | None = None  # rank 0: its cores and threads before
        self._store = dist.TCPStore(
            "127.0.0.1",
            port,
            shard.size,
            shard.rank == 0,
            timeout=timedelta(seconds=INIT_TIMEOUT_S),
        )
        options = dist.ProcessGroupGloo._Options()
        # no timeout on steps: an idle engine's ranks wait for the next one as long as it takes;
        # a rank that dies closes its sockets, which fails the others' collectives at once
        options._timeout = timedelta(days=365)
        # the ranks are one host's processes: their pairs (the steps' inputs) stay on it
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self._pg = dist.ProcessGroupGloo(self._store, shard.rank, shard.size, options)

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (in float32: gloo and the sum order alike)."""
        if self.size == 1:
            return x
        total = x.float()
        self._pg.allreduce([total]).wait()
        return total.to(x.dtype)

    def broadcast(self, obj, kind=None):
        """Rank 0 sends `obj` to every rank and returns it; the others return it decoded as
        `kind` (msgspec: typed, no pickle; tensors and arrays as dtype, shape and bytes)."""
        data = _encode(obj) if self.shard.rank == 0 else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([data.numel()])
        self._pg.broadcast(size, 0).wait()
        if self.shard.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        self._pg.broadcast(data, 0).wait()
        return obj if self.shard.rank == 0 else _decode(data, kind)

    def gather(self, obj, kind: type) -> list:
        """Every rank's `obj` (of type `kind`), in rank order, on every rank."""
        data = _encode(obj)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.size)]
        self._pg.allgather([sizes], [torch.tensor([data.numel()])]).wait()
        longest = max(int(s) for s in sizes)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        self._pg.allgather([out], [padded]).wait()
        return [_decode(o[: int(s)], kind) for o, s in zip(out, sizes, strict=True)]

    def send_step(self, input_ids, positions, meta: AttentionMetadata) -> None:
        """Rank 0: the step's inputs to the other ranks (`follow`)."""
        self.broadcast(Step(input_ids, positions, meta.slot_mapping, meta.num_decodes,
                            meta.decode_groups, meta.prefills))  # fmt: skip

    def caches(self, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int):
        """This rank's KV cache (K and V: `num_layers` tensors of `shape` each), and on rank 0
        every rank's, in rank order. Collective: every rank calls it at once. The other ranks'
        are `shared_caches` that rank 0 maps."""
        if self.shard.rank == 0:
            mine = [torch.zeros(shape, dtype=dtype) for _ in range(2 * num_layers)]
            handle = None
        else:
            mine, handle = shared_caches(shape, dtype, num_layers)
        handles = self.gather(handle, tuple[int, int] | None)
        ranks = [_split(mine, num_layers)]
        if self.shard.rank == 0:
            for pid, fd in handles[1:]:
                ranks.append(_split(map_caches(pid, fd, shape, dtype, num_layers), num_layers))
        return ranks

    def close(self) -> None:
        """Rank 0: the other ranks stop (they leave their loop and exit)."""
        if self.shard.rank == 0 and self._pg is not None:
            try:
                self.broadcast(None)  # no Step: stop
            except RuntimeError:
                pass  # a rank is gone already
        self._pg = self._store = None
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.restore is not None:  # this process lives on (tests): unpin it
            os.sched_setaffinity(0, self.restore[0])
            torch.set_num_threads(self.restore[1])
            self.restore = None


class Step(msgspec.Struct):
    """One step's inputs, as rank 0 prepared them (`ModelRunner._prepare`)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping, self.num_decodes, self.decode_groups,
                                 self.prefills)  # fmt: skip


class Start(msgspec.Struct):
    """What the other ranks build their part from: the engine config and the model."""

    config: EngineConfig
    model: ModelConfig
    weights: dict[str, np.ndarray]
    fingerprint: str
    path: str | None
    max_model_len: int

    def files(self) -> ModelFiles:
        return ModelFiles(self.path and Path(self.path), self.model, self.weights, self.fingerprint)


def _enc_hook(obj):
    if isinstance(obj, torch.Tensor):
        obj = obj.contiguous()
        return (str(obj.dtype).removeprefix("torch."), list(obj.shape),
                obj.reshape(-1).view(torch.uint8).numpy().tobytes())  # fmt: skip
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes())
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to the other ranks")


def _dec_hook(kind: type, obj):
    if kind is torch.Tensor:
        dtype, shape, data = obj
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return flat.view(getattr(torch, dtype)).reshape(shape)
    if kind is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(bytearray(data), dtype=np.dtype(dtype)).reshape(shape)
    raise NotImplementedError(f"cannot receive a {kind.__name__} from rank 0")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def _encode(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(_ENCODER.encode(obj)), dtype=torch.uint8)


def _decode(data: torch.Tensor, kind: type):
    return msgspec.msgpack.decode(data.numpy().tobytes(), type=kind, dec_hook=_dec_hook)


def _split(tensors: list[torch.Tensor], num_layers: int):
    return tensors[:num_layers], tensors[num_layers:]


def shared_caches(shape: tuple[int, ...], dtype: torch.dtype, num_layers: int):
    """K then V caches (`num_layers` tensors of `shape` each, zeros) in a memfd of this process,
    and (pid, fd): another process of this user maps them with `map_caches`."""
    fd = os.memfd_create("pdserve-kv")
    os.ftruncate(fd, 2 * num_layers * _nbytes(shape, dtype))
    return _map(fd, shape, dtype, num_layers), (os.getpid(), fd)


def map_caches(pid: int, fd: int, shape, dtype, num_layers: int):
    """The caches of `shared_caches` in process `pid`, mapped into this one."""
    own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        return _map(own, shape, dtype, num_layers)
    finally:
        os.close(own)  # the mapping stays


def _nbytes(shape, dtype: torch.dtype) -> int:
    return int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()


def _map(fd: int, shape, dtype: torch.dtype, num_layers: int) -> list[torch.Tensor]:
    size = _nbytes(shape, dtype)
    buf = mmap.mmap(fd, 2 * num_layers * size)
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the mapping alive
    return [flat[i * size : (i + 1) * size].view(dtype).view(shape) for i in range(2 * num_layers)]


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
    group = TPGroup(TPShard(0, size), port, procs)
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
    config = replace(start.config, num_threads=threads)
    runner = ModelRunner(config, start.files(), start.max_model_len, group)
    del start
    try:
        while (step := group.broadcast(None, Step | None)) is not None:
            runner.forward(step.input_ids, step.positions, step.meta())
    except RuntimeError:  # rank 0 went away without saying so (it exited, or was killed)
        log.warning("tensor-parallel rank %d: rank 0 is gone; exiting", rank)


def main() -> None:
    p = argparse.ArgumentParser(description="one rank of a tensor-parallel engine (started by "
                                "rank 0; not run by hand)")  # fmt: skip
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


if __name__ == "__main__":
    main()
