"""A worker's link to the KV store (Mooncake-style pool): load cached prefixes, offload blocks.

At admission the worker asks the store for the longest prefix beyond its own prefix-cache hits
and loads those blocks straight into the sequence's new blocks instead of computing them. The
load streams layer by layer on a thread of its own while the engine's next step computes the
rest of the prompt: before layer i the model waits for layer i of the prefix (`StoreLoad`), as
a decode worker's KV arrives layer by layer from a prefill worker. If the load falls short, that
step is void for the sequence and the next computes what did not land. A prefill worker loads
before its step instead (it streams each layer on to a decode worker as soon as it is computed,
so that layer's prefix must already be known good). Blocks reach the store two ways, both
asynchronous:

* a finished request's full blocks, sent straight from cache memory: the worker holds the blocks
  until the store has read them (`poll` names the requests it may release);
* a block evicted from the worker's prefix cache (the block manager is about to reuse it): its
  bytes are copied out at once (one block, e.g. 360 KiB for SmolLM2-135M in bf16) unless the
  store is known to hold it, the store is unreachable right now, or copies in flight already
  take `max_copy_bytes`; the copies go out in one put per engine-loop iteration.

The link also keeps the router's view of the store current: `take_index_events` lists hashes the
store now holds (puts that completed, loads) and hashes it reported gone (its evictions), in
order. Any store failure only means "compute it": never an error, never a held block.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from pdserve.engine.block import Block
from pdserve.engine.block_hash import block_hashes
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_connector import PrefixLoader
from pdserve.engine.sequence import Sequence
from pdserve.kv_store.client import LayerLoad, StoreClient
from pdserve.kv_store.config import payload_bytes
from pdserve.kv_store.protocol import BlockMeta

log = logging.getLogger("pdserve.worker")
KNOWN_CAPACITY = 1 << 16  # hashes remembered as held by the store (an LRU; a miss costs a copy)


class StoreLink(PrefixLoader):
    """The engine's KV connector to the store. `overlap_loads`: a prefix may load under the
    step that computes the rest (not on a prefill worker, which streams each layer on as soon
    as it is computed). `offload_finished`: a finished request's blocks are offloaded, and held
    until the store has read them (`poll`). `settle`: called before a load writes blocks or an
    eviction copies one (a pipeline-parallel engine's `PPGroup.drain`: its later stages may
    still be computing into blocks stage 0 has freed)."""

    def __init__(
        self,
        client: StoreClient,
        block_manager: BlockManager,
        overlap_loads: bool = True,
        offload_finished: bool = True,
        max_copy_bytes: int = 64 << 20,
        settle: Callable[[], None] | None = None,
    ):
        self.client = client
        self.settle = settle or (lambda: None)
        self.bm = block_manager
        self.overlap_loads, self.offload_finished = overlap_loads, offload_finished
        self.block_size = client.layout.block_size
        self.max_copy_bytes = max_copy_bytes
        self.pending: dict[str, tuple] = {}  # request id -> (PutTicket, hashes)
        self.evicting: list[tuple] = []  # (PutTicket, hashes, bytes) of evicted copies in flight
        self.copies: list[tuple[BlockMeta, bytearray]] = []  # evicted, not yet queued
        self.copy_bytes = 0  # of `copies` and `evicting` together
        # hashes the store holds as far as this worker knows: their evicted blocks are not copied
        self.known: OrderedDict[int, None] = OrderedDict()
        self.index_events: list[tuple[int, bool]] = []  # (hash, held) for the router, in order
        self.hit_tokens = self.query_tokens = 0
        # request -> (tokens looked up, tokens the store held) of its admission, kept for the
        # decode side's traces when tracing is on (None: not kept)
        self.lookups: dict[str, tuple[int, int]] | None = None
        self.evicted_offloads = 0  # evicted blocks whose copies the store took
        self.load_s = 0.0
        self.aside: list[int] = []  # blocks an abandoned load may still write (StoreLoad.finish)

    @classmethod
    def for_role(
        cls, client: StoreClient, block_manager: BlockManager, role: str,
        settle: Callable[[], None] | None = None,
    ) -> StoreLink:  # fmt: skip
        """A prefill worker streams each layer on as soon as it is computed, so a prefix
        loading under its step could be sent before it is known good: it loads before the
        step instead; and its finished blocks go to a decode worker, not the store. `settle`
        as in the constructor."""
        decodes = role != "prefill"
        return cls(client, block_manager, overlap_loads=decodes, offload_finished=decodes,
                   settle=settle)  # fmt: skip

    # -- KVConnector ---------------------------------------------------------------------
    def on_allocate(self, seq: Sequence, under_step: bool) -> None:
        self.load_prefix(seq, self.overlap_loads and under_step)

    def request_finished(self, seq: Sequence) -> bool:
        return self.offload_finished and self.offload(seq)

    # -- loads and offloads ----------------------------------------------------------------
    def load_prefix(self, seq: Sequence, overlap: bool = False) -> int:
        """Fill seq's blocks after its local prefix hits with blocks from the store. Never the
        block holding the last token (it must be computed to sample). Returns tokens loaded,
        or with `overlap` tokens being loaded: seq.prefix_load then says how many landed."""
        bs = self.block_size
        start, limit = seq.num_cached_tokens // bs, (seq.num_tokens - 1) // bs
        if start >= limit or seq.params.prompt_logprobs is not None:  # computes every position
            return 0
        hashes = block_hashes(seq.token_ids[: limit * bs], bs)
        self.query_tokens += (limit - start) * bs
        t = time.monotonic()
        n = self.client.lookup(hashes[start:])
        if self.lookups is not None:
            self.lookups[seq.request_id] = ((limit - start) * bs, n * bs)
        if n == 0:
            return 0
        wanted, dst = hashes[start : start + n], seq.block_table[start : start + n]
        tokens = [seq.token_ids[i * bs : (i + 1) * bs] for i in range(start, start + n)]
        parent = hashes[start - 1] if start else None
        self.settle()
        if overlap:
            job = self.client.start_load(wanted, dst, tokens, parent)
            seq.prefix_load = StoreLoad(self, seq, job, wanted, start * bs, n * bs, t)
            seq.num_cached_tokens = seq.num_computed_tokens = (start + n) * bs
            return n * bs
        loaded = self.client.load(wanted, dst, token_ids_per_block=tokens, parent=parent)
        landed = self._landed(wanted, loaded, t)
        if landed:
            seq.num_cached_tokens = seq.num_computed_tokens = (start + landed) * bs
            self.bm.register_computed(seq)  # now also a local prefix-cache entry
        return landed * bs

    def _landed(self, hashes: list[int], landed: int, started: float) -> int:
        """Count a load that has ended (`landed` of `hashes` intact); returns `landed`."""
        self.load_s += time.monotonic() - started
        self.hit_tokens += landed * self.block_size
        self._held(hashes[:landed])
        return landed

    def offload(self, seq: Sequence) -> bool:
        """Queue seq's full computed blocks for the store; True if its blocks must be held
        until `poll()` lists it."""
        bs = self.block_size
        n = min(seq.num_computed_tokens, seq.num_tokens) // bs
        if n == 0:
            return False
        hashes = block_hashes(seq.token_ids[: n * bs], bs)
        tokens = [seq.token_ids[i * bs : (i + 1) * bs] for i in range(n)]
        ticket = self.client.put(hashes, tokens, seq.block_table[:n])
        self.pending[seq.request_id] = (ticket, hashes)
        return True

    def on_evict(self, block: Block) -> None:
        """KVConnector: `block` (cached, unreferenced) is about to be reused. Copy its KV
        out for the store unless that is known to be useless or costly right now. Never raises:
        the engine step must not fail for the store's sake."""
        if block.hash in self.known or self.client.backing_off:
            return
        nbytes = payload_bytes(self.client.layout)
        if self.copy_bytes + nbytes > self.max_copy_bytes:
            return  # the store is slower than evictions: drop this one
        try:
            self.settle()
            payload = self.client.snapshot(block.block_id)
        except Exception:
            log.exception("could not copy evicted block %d for the KV store", block.block_id)
            return
        self.copies.append((BlockMeta(block.hash, block.parent, list(block.token_ids)), payload))
        self.copy_bytes += nbytes

    def poll(self) -> list[str]:
        """Queue evicted copies; return the requests whose blocks the store has finished
        reading (ok or not), which the caller may release now. Cheap when nothing is pending."""
        if self.aside and not self.client.late_writes():  # the late call has returned
            self.bm.give_back(self.aside)
            self.aside = []
        if self.copies:
            self._queue_copies()
        for job in [j for j in self.evicting if j[0].done()]:
            ticket, hashes, nbytes = job
            self.evicting.remove(job)
            self.copy_bytes -= nbytes
            if ticket.ok:
                self.evicted_offloads += len(hashes)
                self._held(hashes)
        out = []
        for rid, (ticket, hashes) in list(self.pending.items()):
            if ticket.done():
                if ticket.ok:
                    self._held(hashes)
                del self.pending[rid]
                out.append(rid)
        return out

    def _queue_copies(self) -> None:
        metas, payloads = zip(*self.copies, strict=True)
        nbytes = sum(len(p) for p in payloads)
        self.copies = []
        try:
            ticket = self.client.put_copies(metas, payloads)
        except ValueError:  # a bug, not a store failure: lose these copies, not the worker
            log.exception("could not offload %d evicted blocks", len(metas))
            self.copy_bytes -= nbytes
            return
        self.evicting.append((ticket, [m.block_hash for m in metas], nbytes))

    def take_index_events(self) -> list[tuple[int, bool]]:
        """(hash, held) in order since the last call: True once a put or load showed the store
        holds it, False once the store reported it gone (its evictions)."""
        for h in self.client.drain_removed():
            self.known.pop(h, None)
            self.index_events.append((h, False))
        events, self.index_events = self.index_events, []
        return events

    def _held(self, hashes: list[int]) -> None:
        for h in hashes:
            self.known[h] = None
            self.known.move_to_end(h)
            self.index_events.append((h, True))
        while len(self.known) > KNOWN_CAPACITY:
            self.known.popitem(last=False)

    def close(self) -> None:
        self.poll()
        self.client.flush(2.0)
        self.client.close()


class StoreLoad:
    """A prefix load running under an engine step (the engine's `PrefixLoad`)."""

    def __init__(self, link: StoreLink, seq: Sequence, job: LayerLoad, hashes, first_token,
                 num_tokens, t):  # fmt: skip
        self.link, self.seq, self.job, self.hashes, self.started = link, seq, job, hashes, t
        self.first_token, self.num_tokens = first_token, num_tokens

    def wait_layer(self, layer: int) -> None:
        self.job.wait_layer(layer)

    def finish(self) -> int:
        link, seq = self.link, self.seq
        landed = link._landed(self.hashes, self.job.result(), self.started) * link.block_size
        late = link.client.late_writes()  # an abandoned call may still write these blocks
        cut = [i for i, b in enumerate(seq.block_table) if b in late]
        if cut:  # the sequence computes on in new blocks; these wait for the call to return
            seq.num_computed_tokens = seq.num_cached_tokens = self.first_token + landed
            link.aside += link.bm.set_aside(seq, min(cut), set(late))
        return landed


def split_index_events(events: list[tuple[int, bool]]) -> tuple[list[int], list[int]]:
    """(held, removed): the latest word on each hash of `events` (in order), so that the two
    lists are disjoint and the router may apply them in either order."""
    latest = dict(events)
    return [h for h, held in latest.items() if held], [h for h, held in latest.items() if not held]
