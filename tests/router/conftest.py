"""RouterCore without workers: WorkerInfo and RequestState are set up by hand."""

from __future__ import annotations

import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore
from pdserve.router.state import RequestState, WorkerInfo
from pdserve.protocol import messages as m


def load(prefill_tok_s: float = 0.0, decode_step_s: float = 0.0) -> m.Load:
    return m.Load(
        waiting=0, transferring=0, running=0, queued_tokens=0, free_blocks=100,
        total_blocks=100, prefix_hit_tokens=0, prefix_query_tokens=0, preemptions=0,
        prefill_tok_s=prefill_tok_s, decode_step_s=decode_step_s,
    )  # fmt: skip


def worker(wid: str, role: str, load: m.Load | None) -> WorkerInfo:
    return WorkerInfo(wid, role, None, None, 100, 2048, 0, load=load)


def pending(core: RouterCore, rid: str, tokens: int, remote: bool, decode_id: str):
    """A request admitted on `decode_id` that has no first token yet."""
    params = m.Params(max_tokens=8)
    state = RequestState(
        rid, [1] * tokens, params, remote, decode_id=decode_id, uncached_tokens=tokens
    )
    core.requests[rid] = state
    core.workers[decode_id].inflight.add(rid)
    return state


@pytest.fixture
def core():
    """core(**RouterConfig fields) -> a RouterCore whose socket is closed after the test."""
    cores = []

    def make(**config) -> RouterCore:
        c = RouterCore(RouterConfig(**config))
        cores.append(c)
        return c

    yield make
    for c in cores:
        c.sock.close()
