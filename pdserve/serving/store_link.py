"""A worker's link to the KV store (Mooncake-style pool): load cached prefixes, offload blocks.

At admission the worker asks the store for the longest prefix beyond its own prefix-cache hits
and loads those blocks straight into the sequence's new blocks instead of computing them. When a
request finishes, its full blocks are written to the store asynchronously; the worker holds the
blocks until the store has read them. Any store failure only means "compute it": never an error.
"""

from __future__ import annotations

import logging
import time

from pdserve.engine.block_hash import block_hashes
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer import KVLayout

log = logging.getLogger("pdserve.worker")


class StoreLink:
    def __init__(self, endpoint: str, layout: KVLayout, k_caches, v_caches, timeout_s: float = 5.0):
        from pdserve.kv_store.client import StoreClient

        self.client = StoreClient(endpoint, layout, k_caches, v_caches, timeout_s=timeout_s)
        self.block_size = layout.block_size
        self.pending: dict[str, object] = {}  # request id -> PutTicket
        self.offloaded: list[int] = []  # hashes stored since the last heartbeat (router's index)
        self.hit_tokens = self.query_tokens = 0
        self.load_s = 0.0

    def load_prefix(self, seq: Sequence, bm: BlockManager) -> int:
        """Fill seq's blocks after its local prefix hits with blocks from the store. Never the
        block holding the last token (it must be computed to sample). Returns tokens loaded."""
        bs = self.block_size
        start, limit = seq.num_cached_tokens // bs, (seq.num_tokens - 1) // bs
        if start >= limit:
            return 0
        hashes = block_hashes(seq.token_ids[: limit * bs], bs)
        self.query_tokens += (limit - start) * bs
        t = time.monotonic()
        n = self.client.lookup(hashes[start:])
        if n == 0:
            return 0
        tokens = [seq.token_ids[i * bs : (i + 1) * bs] for i in range(start, start + n)]
        landed = self.client.load(
            hashes[start : start + n],
            seq.block_table[start : start + n],
            token_ids_per_block=tokens,
            parent=hashes[start - 1] if start else None,
        )
        self.load_s += time.monotonic() - t
        if landed == 0:
            return 0
        seq.num_cached_tokens = seq.num_computed_tokens = (start + landed) * bs
        bm.register_computed(seq)  # now also a local prefix-cache entry
        self.hit_tokens += landed * bs
        return landed * bs

    def offload(self, seq: Sequence) -> bool:
        """Queue seq's full computed blocks for the store; True if its blocks must be held
        until `done()` lists it."""
        bs = self.block_size
        n = min(seq.num_computed_tokens, seq.num_tokens) // bs
        if n == 0:
            return False
        hashes = block_hashes(seq.token_ids[: n * bs], bs)
        tokens = [seq.token_ids[i * bs : (i + 1) * bs] for i in range(n)]
        ticket = self.client.put(hashes, tokens, seq.block_table[:n])
        self.pending[seq.request_id] = (ticket, hashes)
        return True

    def done(self) -> list[str]:
        """Requests whose blocks the store has finished reading (ok or not)."""
        out = []
        for rid, (ticket, hashes) in list(self.pending.items()):
            if ticket.done():
                if ticket.ok:
                    self.offloaded.extend(hashes)
                del self.pending[rid]
                out.append(rid)
        return out

    def close(self) -> None:
        self.client.flush(2.0)
        self.client.close()
