"""RouterCore without workers or sockets: WorkerInfo and RequestState are set up by hand, and
what the core sends is recorded."""

from __future__ import annotations

import pytest

from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore
from pdserve.router.state import RequestState, WorkerInfo


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
    params = SamplingParams(max_tokens=8)
    state = RequestState(
        rid, [1] * tokens, params, remote, decode_id=decode_id, uncached_tokens=tokens
    )
    core.requests[rid] = state
    core.workers[decode_id].inflight.add(rid)
    return state


class Recorder:
    """A control channel that keeps what the core sends, as (worker id, message)."""

    endpoint = "tcp://127.0.0.1:1"

    def __init__(self):
        self.sent: list[tuple[str, object]] = []

    def send(self, worker_id: str, msg) -> bool:
        self.sent.append((worker_id, msg))
        return True

    def take(self) -> list[tuple[str, object]]:
        out, self.sent = self.sent, []
        return out

    def close(self) -> None:
        pass


@pytest.fixture
def core():
    """core(**RouterConfig fields) -> a RouterCore sending into a Recorder (`core.channel`)."""

    def make(**config) -> RouterCore:
        return RouterCore(RouterConfig(**config), channel=Recorder())

    return make
