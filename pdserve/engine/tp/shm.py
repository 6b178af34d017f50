"""The KV caches of a tensor-parallel engine's other ranks in shared memory: each rank's K and V
caches in a memfd of its own process, which rank 0 maps through /proc/PID/fd, so the worker's KV
connectors (in rank 0) read and write every rank's heads."""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch


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
    buf = mmap.mmap(fd, count * size)
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the mapping alive
    return [flat[i * size : (i + 1) * size].view(dtype).view(shape) for i in range(count)]
