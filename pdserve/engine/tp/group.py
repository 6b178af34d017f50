"""A rank's place in a tensor-parallel group and its collectives over gloo: the all-reduce of
the partial sums, rank 0's broadcast of each step (`codec.py`), a gather, and the KV caches of
every rank as rank 0 sees them (the others' in shared memory: `shm.py`)."""

from __future__ import annotations

import os
import subprocess
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.engine.kv_memory import map_caches, shared_caches, zeroed_caches
from pdserve.engine.tp.codec import Step, decode, encode
from pdserve.engine.tp.shard import TPShard
from pdserve.model.attention import AttentionMetadata

INIT_TIMEOUT_S = 300.0  # for the other ranks to start, load and join
LOOPBACK = "127.0.0.1"  # a group of one host's processes: its pairs stay on it


class TPGroup:
    """This process's place in the group and its collectives."""

    def __init__(self, shard: TPShard, port: int, procs: list[subprocess.Popen] | None = None):
        """Join the group's gloo process group (rank 0 hosts its rendezvous at `port`:
        `gloo_group`)."""
        self.shard, self.procs = shard, procs or []
        self.restore: tuple[set[int], int] | None = None  # rank 0: its cores and threads before
        self._store, self._pg = gloo_group(shard.rank, shard.size, port)

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
        data = encode(obj) if self.shard.rank == 0 else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([data.numel()])
        self._pg.broadcast(size, 0).wait()
        if self.shard.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        self._pg.broadcast(data, 0).wait()
        return obj if self.shard.rank == 0 else decode(data, kind)

    def gather(self, obj, kind: type) -> list:
        """Every rank's `obj` (of type `kind`), in rank order, on every rank."""
        data = encode(obj)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.size)]
        self._pg.allgather([sizes], [torch.tensor([data.numel()])]).wait()
        longest = max(int(s) for s in sizes)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        self._pg.allgather([out], [padded]).wait()
        return [decode(o[: int(s)], kind) for o, s in zip(out, sizes, strict=True)]

    def send_step(self, input_ids, positions, meta: AttentionMetadata) -> None:
        """Rank 0: the step's inputs to the other ranks (`follow`)."""
        self.broadcast(Step(input_ids, positions, meta.slot_mapping, meta.num_decodes,
                            meta.decode_groups, meta.prefills))  # fmt: skip

    def caches(
        self, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int, per_layer=2,
        held: range | None = None,
    ):  # fmt: skip
        """This rank's KV cache (K and V: `num_layers` tensors of `shape` each; `per_layer` 1:
        MLA's latent, and V empty), and on rank 0 every rank's, in rank order. Collective:
        every rank calls it at once. The other ranks' are `shared_caches` that rank 0 maps.
        `held`: a pipeline stage's layers, the only ones allocated (the others empty)."""
        held = range(num_layers) if held is None else held
        count = per_layer * len(held)
        if self.shard.rank == 0:
            mine = zeroed_caches(shape, dtype, count)
            handle = None
        else:
            mine, handle = shared_caches(shape, dtype, count)
        handles = self.gather(handle, tuple[int, int] | None)
        ranks = [spread(mine, num_layers, held, per_layer)]
        if self.shard.rank == 0:
            for pid, fd in handles[1:]:
                mapped = map_caches(pid, fd, shape, dtype, count)
                ranks.append(spread(mapped, num_layers, held, per_layer))
        return ranks

    def close(self) -> None:
        """Rank 0: the other ranks stop (they leave their loop and exit)."""
        if self.shard.rank == 0 and self._pg is not None:
            try:
                self.broadcast(None)  # no Step: stop
            except RuntimeError:
                pass  # a rank is gone already
        self._pg = self._store = None
        reap(self.procs, self.restore)
        self.restore = None


def gloo_group(rank: int, size: int, port: int, master: str = LOOPBACK, address: str = LOOPBACK):
    """(store, process group): this process as `rank` of a gloo group of `size` processes,
    whose rank 0 hosts the rendezvous at `master`:`port`, reached by the others at their own
    `address` (loopback: one host's processes; a pipeline's stages that Ray placed on other
    hosts give their host's). The group is its engine's own, not torch.distributed's default
    one: a process may hold several engines (tests do). Shared by the tensor-parallel ranks and
    the pipeline's stages (`engine/pp/`)."""
    store = dist.TCPStore(master, port, size, rank == 0, timeout=timedelta(seconds=INIT_TIMEOUT_S))
    options = dist.ProcessGroupGloo._Options()
    # no timeout on steps: an idle engine's ranks wait for the next one as long as it takes;
    # a rank that dies closes its sockets, which fails the others' collectives at once
    options._timeout = timedelta(days=365)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return store, dist.ProcessGroupGloo(store, rank, size, options)


def spread(tensors: list[torch.Tensor], num_layers: int, held: range, per_layer: int = 2):
    """(K caches, V caches) indexed by the model's layer number, from the tensors allocated
    for the `held` layers (all K, then all V; V empty for a latent): an empty tensor in place
    of each layer not held."""
    empty = torch.empty(0, dtype=tensors[0].dtype) if tensors else torch.empty(0)
    k, v = [empty] * num_layers, [empty] * num_layers
    n = len(held)
    for j, layer in enumerate(held):
        k[layer] = tensors[j]
        if per_layer == 2:
            v[layer] = tensors[n + j]
    return k, (v if per_layer == 2 else [])


def reap(procs, restore) -> None:
    """Wait for a group's other processes (TP ranks, pipeline stages) to exit, killing any
    that have not within 10 s; then unpin this process where it lives on (tests): `restore`
    is its (cpus, threads) before the group pinned it, or None."""
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if restore is not None:
        os.sched_setaffinity(0, restore[0])
        torch.set_num_threads(restore[1])
