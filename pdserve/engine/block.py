"""One paged KV block's bookkeeping (the block manager's unit; a KV connector is told of it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    parent: int | None = None  # the hash this block's hash chains from (None: first block)
    token_ids: tuple[int, ...] = ()
