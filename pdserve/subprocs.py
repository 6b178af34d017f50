"""What every launcher of local processes needs (torch-free: the router process uses it):
a free port on this host, children that die with the process that started them, cores split
among them, a heap given back to the system once a burst of work is over, and the exit status
by which a worker tells its launcher that restarting it cannot help."""

from __future__ import annotations

import ctypes
import signal
import socket

# The exit status of a worker that cannot serve as it is configured: the router refused it (its
# KV layout, model or dtype differ from the workers already serving) or its flags or model are
# wrong. Started again with the same command line it would fail the same way, so a launcher
# stops (during start-up) or reports it and leaves it down (once serving) instead of
# restarting it. 78 is EX_CONFIG of sysexits.h.
EXIT_CONFIG = 78


class WorkerRefused(RuntimeError):
    """The router refused this worker's registration (`RegisterAck(ok=False)`, e.g. a KV layout
    mismatch): the worker exits with `EXIT_CONFIG`."""


def cannot_restart(exc: BaseException) -> bool:
    """Whether `exc`, raised while a worker starts, is one a restart cannot fix: a refusal by
    the router, or a wrong setting (ValueError) or model path (FileNotFoundError)."""
    return isinstance(exc, WorkerRefused | ValueError | FileNotFoundError)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """Linux (as a `preexec_fn`): SIGTERM this child when its parent dies, however it dies (even
    kill -9), so no orphaned process keeps a core busy."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def trim_heap() -> None:
    """glibc: give the freed parts of the heap back to the system (`malloc_trim`). A prefill's
    activations are freed when it ends, but glibc keeps most of those pages mapped, so a
    worker's RSS would step up with every longer prompt than before; elsewhere a no-op."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def split_cores(cores: list[int], weights: list[int]) -> list[list[int]]:
    """One group of `cores` per weight, contiguous and in proportion to the weights when there
    are cores for every weight unit, else equal; with fewer cores than groups, the groups share
    cores round-robin (one each). Workers of `pdserve serve`, and a worker's ranks."""
    n = len(weights)
    if n < 1:
        raise ValueError("need at least one worker")
    if len(cores) < n:
        return [[cores[i % len(cores)]] for i in range(n)]
    if len(cores) < sum(weights):
        weights = [1] * n
    unit, groups, start = len(cores) // sum(weights), [], 0
    for w in weights:
        groups.append(cores[start : start + unit * w])
        start += unit * w
    return groups
