"""Where a request goes: pure functions over a `ClusterView`, a snapshot of the workers the
router believes alive and of the prompt tokens waiting to be prefilled.

`place` is the whole decision for a new request: the decode-capable worker that reaches its
first token soonest (`pick_decode`), how much of the prompt is cached there (its own prefix
cache, then the KV store: `cached_blocks`), and whether the uncached rest is prefilled by the
prefill pool or on that worker (`prefill_remotely`). `pick_prefill` chooses the prefill worker
once the decode worker has placed blocks for the KV. Nothing here sends a message or mutates a
worker: the core acts on the returned choices.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass

from pdserve.engine.block_hash import block_hashes
from pdserve.router.config import RouterConfig
from pdserve.router.state import RequestState, WorkerInfo


class NoWorker(Exception):
    """No live worker can take the request (the client should retry later: 503)."""


@dataclass(frozen=True)
class ClusterView:
    """What placement and admission read. `queues`: prompt tokens admitted but not yet
    prefilled, keyed by where they are prefilled (None: the prefill pool; else the id of the
    decode worker prefilling them itself). `store_index`: block hashes the KV store holds."""

    workers: tuple[WorkerInfo, ...]  # alive ones only
    queues: Mapping[str | None, int]
    store_index: Set[int] = frozenset()

    @classmethod
    def of(
        cls,
        workers: Iterable[WorkerInfo],
        requests: Iterable[RequestState],
        store_index: Set[int] = frozenset(),
    ) -> ClusterView:
        live = tuple(w for w in workers if w.alive and not w.draining)  # (places new work)
        return cls(live, prefill_queues(requests), store_index)

    @property
    def decoders(self) -> list[WorkerInfo]:
        return [w for w in self.workers if w.can_decode]

    @property
    def prefill_pool(self) -> list[WorkerInfo]:
        return [w for w in self.workers if w.role == "prefill"]

    def queued(self, remote: bool, decode_id: str) -> int:
        """Prompt tokens waiting ahead of a new one prefilled in the pool (remote) or on
        decode worker `decode_id`."""
        return self.queues.get(None if remote else decode_id, 0)


def prefill_queues(requests: Iterable[RequestState]) -> Counter[str | None]:
    """Prompt tokens admitted but not yet prefilled (no token delivered), by where."""
    queues: Counter[str | None] = Counter()
    for s in requests:
        if not s.tokens:
            queues[None if s.remote else s.decode_id] += s.uncached_tokens
    return queues


@dataclass(frozen=True, kw_only=True)
class Choice:
    decode: WorkerInfo
    remote: bool  # prefilled by the prefill pool (else on `decode`)
    warm: bool  # at least half the prompt is cached (worker or KV store)
    uncached: int  # prompt tokens someone must compute
    why: str = ""  # the prefill location's reason, for traces


def prefill_reason(
    config: RouterConfig, view: ClusterView, decode: WorkerInfo, uncached: int, warm: bool,
    remote: bool,
) -> str:  # fmt: skip
    """Why `prefill_remotely` answered `remote` (a span attribute, docs/observability.md)."""
    if config.mode != "disagg" or decode.role != "decode":
        return "co-located worker"
    if not view.prefill_pool:
        return "no prefill worker"
    if remote:
        if uncached >= config.local_prefill_threshold:
            return "uncached part at or above --local-prefill-threshold"
        return "short prompt, prefill pool idle"
    if warm:
        return "warm prompt: cached prefix on the decode worker"
    if uncached == 0:
        return "whole prompt cached"
    if not config.short_prefills_to_idle_pool:
        return "short prompt (--keep-short-prefills-local)"
    return "short prompt, prefill pool busy"


def place(
    config: RouterConfig, view: ClusterView, prompt: list[int], near: str | None = None
) -> Choice:
    """The decode worker and the prefill location of a new request; NoWorker if none.
    `near`: a decode worker that holds this prompt's KV (a sibling of `n` computed it there and
    its index may not know yet): the request goes there and computes only its last block."""
    for w in view.decoders:
        if w.worker_id == near:
            return Choice(
                decode=w, remote=False, warm=True, uncached=min(len(prompt), config.block_size),
                why="the KV of a sibling choice (n > 1) is there",
            )  # fmt: skip
    decode = pick_decode(view, prompt, config.block_size)
    cached = cached_blocks(view, decode, block_hashes(prompt, config.block_size))
    overlap = min(cached * config.block_size, len(prompt))
    warm = overlap > 0 and overlap >= len(prompt) // 2
    uncached = len(prompt) - overlap
    remote = prefill_remotely(config, view, decode, uncached, warm)
    why = prefill_reason(config, view, decode, uncached, warm, remote)
    return Choice(decode=decode, remote=remote, warm=warm, uncached=uncached, why=why)


def pick_decode(view: ClusterView, prompt: list[int], block_size: int) -> WorkerInfo:
    """The worker where the prompt would compute the fewest prompt tokens before its first
    token: those queued there for local prefill plus its own uncached ones (a cached prefix
    saves its tokens); then the fewest requests in flight; then the most free blocks. A chat
    request thus does not wait behind another worker's 4k-token prefill to save one cached
    block, nor skip a cached prefix for a worker that is merely idle. NoWorker if none."""
    candidates = view.decoders
    if not candidates:
        raise NoWorker("no decode worker is available")
    hashes = block_hashes(prompt, block_size)

    def cost(w: WorkerInfo) -> tuple[int, int, int]:
        uncached = len(prompt) - min(w.overlap(hashes) * block_size, len(prompt))
        return view.queued(False, w.worker_id) + uncached, len(w.inflight), -w.free_blocks()

    return min(candidates, key=cost)


def pick_prefill(view: ClusterView, prompt: list[int], block_size: int) -> WorkerInfo | None:
    """The prefill worker caching the longest prefix of the prompt; then the least loaded
    (queued prompt tokens, 1,000 per request in flight). None with no prefill worker."""
    candidates = view.prefill_pool
    if not candidates:
        return None
    hashes = block_hashes(prompt, block_size)
    return min(
        candidates,
        key=lambda w: (-w.overlap(hashes), w.queued_prefill_tokens() + 1000 * len(w.inflight)),
    )


def cached_blocks(view: ClusterView, decode: WorkerInfo, hashes: list[int]) -> int:
    """Leading prompt blocks `decode` can get without computing: its own prefix-cache hits,
    then (as it loads them) the blocks right after those that the KV store holds."""
    cached = decode.overlap(hashes)
    if decode.has_store:
        cached = next(
            (i for i in range(cached, len(hashes)) if hashes[i] not in view.store_index),
            len(hashes),
        )
    return cached


def prefill_remotely(
    config: RouterConfig, view: ClusterView, decode: WorkerInfo, uncached: int, warm: bool
) -> bool:
    """Conditional, cache-aware disaggregation. A long *uncached* part goes to the prefill
    pool. A short one is prefilled on the decode worker (no transfer, no extra hops) unless
    the pool is idle: then the pool takes it too, so that the decode worker's running streams
    are not paused by it (--keep-short-prefills-local turns that off). A warm prompt always
    loads its cached prefix (the worker's own cache or the KV store) on the decode worker and
    computes only the suffix there."""
    if config.mode != "disagg" or decode.role != "decode" or not view.prefill_pool:
        return False
    if uncached >= config.local_prefill_threshold:
        return True
    return (
        config.short_prefills_to_idle_pool
        and not warm
        and uncached > 0
        and view.queued(True, decode.worker_id) == 0
    )
