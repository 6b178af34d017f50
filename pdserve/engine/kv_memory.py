"""Where a CPU engine's KV caches live: memory that reads as zeros and is only backed by the
machine once written.

`torch.zeros` writes every byte of a 1 GiB cache at start-up: page faults and page clearing
that cost a worker seconds (more on a virtual machine that has not backed those pages yet: a
second server started beside a first spent half its start clearing pages), for blocks that a
light load never reaches. An anonymous mapping is zeros by definition and is backed page by page
as blocks are first written, so `zeroed_caches` costs nothing at start-up.

A tensor-parallel engine's other ranks (and a pipeline's later stages) keep theirs in a memfd of
their own process, which rank 0 maps through /proc/PID/fd (`shared_caches`, `map_caches`), so
the worker's KV connectors (in rank 0) read and write every rank's heads."""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch


def zeroed_caches(shape: tuple[int, ...], dtype: torch.dtype, count: int) -> list[torch.Tensor]:
    """`count` cache tensors of `shape`, zeros, in one anonymous mapping of this process."""
    return _map(-1, shape, dtype, count)


def shared_caches(shape: tuple[int, ...], dtype: torch.dtype, count: int):
    """`count` cache tensors of `shape` (K then V per layer, or MLA's latents), zeros, in a memfd
    of this process, and (pid, fd): another process of this user maps them with `map_caches`."""
    fd = os.memfd_create("pdserve-kv")
    os.ftruncate(fd, count * _nbytes(shape, dtype))
    return _map(fd, shape, dtype, count), (os.getpid(), fd)


def map_caches(pid: int, fd: int, shape, dtype, count: int):
    """The caches of `shared_caches` in process `pid`, mapped into this one."""
    own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        return _map(own, shape, dtype, count)
    finally:
        os.close(own)  # the mapping stays


def _nbytes(shape, dtype: torch.dtype) -> int:
    return int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()


def _map(fd: int, shape, dtype: torch.dtype, count: int) -> list[torch.Tensor]:
    size = _nbytes(shape, dtype)
    # fd -1: anonymous, and shared (Python's default flags): shmem pages, which this VM's
    # kernel gives no huge pages (shmem_enabled never). Private pages with MADV_HUGEPAGE get
    # them, but a 2 MB page's first touch took ~5 ms there: the closed loop at 64 ran 888 ->
    # 693 tok/s, 846 with the cache touched at start (2.5 s a GiB); docs/results.md, run 28
    buf = mmap.mmap(fd, count * size)
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the mapping alive
    return [flat[i * size : (i + 1) * size].view(dtype).view(shape) for i in range(count)]
