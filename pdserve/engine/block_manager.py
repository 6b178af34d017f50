"""Paged KV blocks with prefix caching, reference counts and LRU eviction.

A block is *cached* when its chained hash is registered: it then survives being freed (ref count
0) in the free queue until it is reused, oldest first. A prefix hit is confirmed by comparing
token ids, so a hash collision can never serve wrong KV.
Invariants (checked by `check_integrity`): every block is either referenced (ref > 0) or in the
free queue, never both; the hash index points only at blocks carrying that hash; a block's ref
count is the tables naming it plus the references set aside (`set_aside`).
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.engine.block import Block
from pdserve.engine.block_hash import hash_block
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.sequence import Sequence


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        connector: KVConnector | None = None,
    ):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block: raise --kv-cache-gb")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.events: list[tuple[str, int]] = []  # ("stored"|"removed", hash), drained by workers
        self.connector = connector or KVConnector()  # told of each eviction (KVConnector.on_evict)
        self.hits = self.queries = 0  # prefix-cache hit rate, in tokens
        self.aside: dict[int, int] = {}  # block id -> references held outside any table

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            self.connector.on_evict(block)
            del self.hash_to_block[block.hash]
            self.events.append(("removed", block.hash))
            block.hash, block.parent, block.token_ids = None, None, ()
        block.ref_count = 1
        return block_id

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Block ids already holding seq's leading full blocks (never the whole sequence:
        the last token is always computed so that there are logits to sample from)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        hits, parent, bs = [], None, self.block_size
        for start in range(0, seq.num_tokens - 1 - bs + 1, bs):
            tokens = tuple(seq.token_ids[start : start + bs])
            parent = hash_block(parent, tokens)
            block_id = self.hash_to_block.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence) -> bool:
        """Give seq blocks for all its tokens, reusing cached prefix blocks. Sets
        num_computed/num_cached_tokens. Returns False (changing nothing) if blocks are short."""
        assert not seq.block_table, "allocate() is for a sequence without blocks"
        hits = self._prefix_hits(seq)
        reusable_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = -(-seq.num_tokens // self.block_size) - len(hits)
        if needed > self.num_free_blocks - reusable_free:
            return False
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        seq.block_table = hits + [self._pop_free() for _ in range(needed)]
        seq.block_hashes = [self.blocks[b].hash for b in hits]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.queries += seq.num_tokens
        self.hits += seq.num_cached_tokens
        return True

    def append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's table to hold num_tokens tokens. False (changing nothing) if short."""
        needed = seq.blocks_needed(num_tokens, self.block_size)
        if needed > self.num_free_blocks:
            return False
        seq.block_table.extend(self._pop_free() for _ in range(needed))
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks at the end of seq's table beyond what num_tokens tokens need (those
        that only held rejected speculative tokens: never hashed)."""
        keep = -(-num_tokens // self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            self._unref(block_id)
        del seq.block_table[keep:]

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    def set_aside(self, seq: Sequence, index: int, block_ids: set[int]) -> list[int]:
        """Cut seq's table at `index` (it has computed nothing there or after): of the blocks
        cut, those in `block_ids` stay referenced, out of every table, until `give_back`
        (a store load that may still write into them); the others are freed. The scheduler
        gives seq new blocks as it computes on (`append_slots`). Returns the blocks kept."""
        bs = self.block_size
        assert len(seq.block_hashes) <= index and seq.num_computed_tokens <= index * bs
        cut, kept = seq.block_table[index:], []
        del seq.block_table[index:]
        for block_id in reversed(cut):
            if block_id in block_ids:
                self.aside[block_id] = self.aside.get(block_id, 0) + 1
                kept.append(block_id)
            else:
                self._unref(block_id)
        return kept

    def give_back(self, block_ids: list[int]) -> None:
        """Drop the references `set_aside` kept."""
        for block_id in block_ids:
            self.aside[block_id] -= 1
            if not self.aside[block_id]:
                del self.aside[block_id]
            self._unref(block_id)

    def register_computed(self, seq: Sequence) -> None:
        """Publish seq's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = hash_block(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block and block.hash is None:
                block.hash, block.parent, block.token_ids = h, parent, tokens
                self.hash_to_block[h] = block.block_id
                self.events.append(("stored", h))

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; tail blocks go to the free queue first so that shared
        prefixes, freed last, are evicted last."""
        self.trim(seq, 0)
        seq.block_hashes = []

    def drain_events(self) -> list[tuple[str, int]]:
        events, self.events = self.events, []
        return events

    def check_integrity(self, live: list[Sequence] | None = None) -> None:
        """Raise AssertionError naming the first broken invariant. `live`: every sequence that
        holds blocks; with it, ref counts must equal the number of tables naming each block."""
        refs = [self.aside.get(b, 0) for b in range(self.num_blocks)]
        for seq in live or ():
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            in_free = block.block_id in self.free_queue
            assert block.ref_count >= 0, f"block {block.block_id} has ref {block.ref_count}"
            assert in_free == (block.ref_count == 0), (
                f"block {block.block_id}: ref {block.ref_count} but in_free={in_free}"
            )
            if live is not None:
                assert refs[block.block_id] == block.ref_count, (
                    f"block {block.block_id}: ref {block.ref_count}, tables {refs[block.block_id]}"
                )
            if block.hash is not None:
                assert self.hash_to_block.get(block.hash) == block.block_id, (
                    f"block {block.block_id} hash not indexed"
                )
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h, f"hash index points at wrong block {block_id}"
        assert len(self.free_queue) <= self.num_blocks
