"""A KV block as objects in a Mooncake Store pool (`kv_store/mooncake.py` puts and loads them).

Keys: `pdserve/<layout key>/r<rank>/<chained block hash>/<part>`: the layout key names the model
fingerprint, dtype, block size and (tensor-parallel shard) head count, so two layouts never share
a block. A block is `L` objects (part = layer: its K then V bytes) plus a meta object (part `m`:
its hash, parent and token ids as JSON), put last. A load reads the meta objects first and
verifies them (`meta_ok`: the hash chains over the token ids, the tokens are the prompt's).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from pdserve.kv_store.config import layout_key
from pdserve.kv_store.mooncake_calls import Buffer
from pdserve.kv_store.protocol import BlockMeta, chains
from pdserve.kv_transfer.layout import KVLayout

META_ROOM = 8192  # room for a meta object: hash, parent, 16-256 token ids as JSON


class PoolBlocks:
    """The keys and objects of blocks of one layout (and tensor-parallel rank) in the pool."""

    def __init__(self, layout: KVLayout, rank: int | str) -> None:
        self.layout = layout
        self.prefix = f"pdserve/{layout_key(layout)}/r{rank}"
        self.layer_bytes = 2 * layout.block_bytes  # one object: a block's K then V of a layer

    def key(self, block_hash: int, part: int | str) -> str:
        return f"{self.prefix}/{block_hash & (1 << 64) - 1:016x}/{part}"

    def layer_keys(self, block_hash: int) -> list[str]:
        return [self.key(block_hash, la) for la in range(self.layout.num_layers)]

    def stage(self, buf: Buffer, metas: Sequence[BlockMeta], sources: Sequence, layer_bytes):
        """Copy blocks into `buf` for one batch upsert: (keys, pointers, sizes) of each block's
        layer objects (`layer_bytes(source, la)`: its K then V bytes of layer la), then of their
        meta objects, last."""
        keys, ptrs, sizes, offset = [], [], [], 0
        lb = self.layer_bytes
        for m, source in zip(metas, sources, strict=True):
            for la in range(self.layout.num_layers):
                buf.view[offset : offset + lb] = layer_bytes(source, la)
                keys.append(self.key(m.block_hash, la))
                ptrs.append(buf.ptr + offset)
                sizes.append(lb)
                offset += lb
        for m in metas:  # meta objects last: after the layers
            blob = json.dumps([m.block_hash, m.parent, m.token_ids]).encode()
            buf.view[offset : offset + len(blob)] = blob
            keys.append(self.key(m.block_hash, "m"))
            ptrs.append(buf.ptr + offset)
            sizes.append(len(blob))
            offset += len(blob)
        return keys, ptrs, sizes

    def stored(self, codes: Sequence[int], n: int) -> list[bool]:
        """Per block of a staged upsert of `n`, whether its layers and its meta were stored."""
        L = self.layout.num_layers
        return [all(c >= 0 for c in codes[j * L : (j + 1) * L]) and codes[n * L + j] >= 0
                for j in range(n)]  # fmt: skip

    def meta_ok(self, blob, block_hash: int, parent: int | None, tokens) -> bool:
        """Whether `blob` is the meta object of `block_hash` after `parent`, with `tokens`
        (None: any) that chain to it."""
        try:
            h, p, ids = json.loads(bytes(blob))
            meta = BlockMeta(int(h), None if p is None else int(p), [int(t) for t in ids])
        except (ValueError, TypeError):
            return False
        return (
            meta.block_hash == block_hash
            and meta.parent == parent
            and len(meta.token_ids) == self.layout.block_size
            and chains(meta)
            and (tokens is None or meta.token_ids == tokens)
        )
