"""Chained block hashes, identical in every process (router, prefill and decode workers).

hash(block i) = H(seed, hash(block i-1), token ids of block i). Python's hash() is salted per
process, so we use blake2b with a fixed key: any two processes agree on every prefix.
"""

from __future__ import annotations

import hashlib
import struct

HASH_SEED = b"pdserve-block-hash-v1"


def hash_block(parent: int | None, token_ids: list[int] | tuple[int, ...]) -> int:
    h = hashlib.blake2b(key=HASH_SEED, digest_size=8)
    h.update(struct.pack("<q", -1 if parent is None else parent))
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return int.from_bytes(h.digest(), "little", signed=True)


def block_hashes(token_ids: list[int], block_size: int, parent: int | None = None) -> list[int]:
    """Hashes of every *full* block of token_ids, chained from `parent`."""
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out
