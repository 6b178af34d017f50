"""`BlockStoreClient`: what the engine's `StoreLink` needs of a KV store client, and the checks
and the threaded load every implementation shares.

Implementations: `StoreClient` (client.py: a `pdserve store`, tcp:// or nixl://) and
`MooncakeStoreClient` (mooncake.py: a Mooncake Store pool, mooncake://). Each provides `put`,
`put_copies`, `snapshot`, `lookup`, `load`, `drain_removed`, `flush`, `close`, `backing_off`;
`layout`, `num_blocks`, `last_error`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from pdserve.engine.block_hash import hash_block
from pdserve.kv_store.config import payload_bytes
from pdserve.kv_store.layer_load import LayerLoad
from pdserve.kv_store.protocol import BlockMeta, chains
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.memory import check_block_ids

log = logging.getLogger("pdserve.kv_store")


class BlockStoreClient:
    """The shared half of a KV store client (see the module docstring)."""

    layout: KVLayout
    num_blocks: int

    def load(self, block_hashes, dst_block_ids, timeout_s=None, token_ids_per_block=None,
             parent=None, on_layer=None) -> int:  # fmt: skip
        raise NotImplementedError

    def start_load(
        self,
        block_hashes: Sequence[int],
        dst_block_ids: Sequence[int],
        token_ids_per_block: Sequence[Sequence[int]] | None = None,
        parent: int | None = None,
    ) -> LayerLoad:
        """`load` on a thread of its own. Do not touch the destination blocks (nor free them)
        before `result()` returns; raises ValueError at once for bad arguments."""
        self._check_load(block_hashes, dst_block_ids)
        job = LayerLoad()

        def run() -> None:
            landed = 0
            try:
                landed = self._threaded_load(block_hashes, dst_block_ids, token_ids_per_block,
                                             parent, job.layer_done)  # fmt: skip
            except Exception:  # load() turns store failures into 0; anything else is a bug
                log.exception("KV store load thread failed")
            finally:
                job.finish(landed)

        threading.Thread(target=run, name="kv-store-load", daemon=True).start()
        return job

    def _threaded_load(self, block_hashes, dst_block_ids, token_ids_per_block, parent,
                       on_layer) -> int:  # fmt: skip
        """The load `start_load` runs. A client may write straight into the cache here (its
        caller reads `late_writes()` once the load has ended); `load` never does."""
        return self.load(block_hashes, dst_block_ids, None, token_ids_per_block, parent,
                         on_layer=on_layer)  # fmt: skip

    def late_writes(self) -> frozenset[int]:
        """Destination blocks of a `start_load` whose call passed its deadline and may still
        write into them until it returns: nothing may use them until this no longer names
        them (`StoreLink` sets them aside). Empty for a client that never abandons a call
        writing into the cache."""
        return frozenset()

    def _check_load(self, block_hashes: Sequence[int], dst_block_ids: Sequence[int]) -> list[int]:
        dst = list(dst_block_ids)
        check_block_ids(dst, self.num_blocks, "load destination")
        if len(dst) != len(block_hashes):
            raise ValueError(f"{len(dst)} destination blocks for {len(block_hashes)} hashes")
        return dst

    def _check_copies(self, blocks: Sequence[BlockMeta], payloads: Sequence) -> None:
        """ValueError if a copied block's hash does not match its token ids, or a payload
        its layout (`put_copies`)."""
        size = payload_bytes(self.layout)
        for meta, payload in zip(blocks, payloads, strict=True):
            if len(meta.token_ids) != self.layout.block_size or not chains(meta):
                raise ValueError(f"block hash {meta.block_hash} does not match its token ids")
            if len(payload) != size:
                raise ValueError(f"a payload of {len(payload)} bytes, not {size}")

    def _metas(self, hashes, tokens, parent: int | None) -> list[BlockMeta]:
        if len(hashes) != len(tokens):
            raise ValueError(f"{len(hashes)} block hashes but {len(tokens)} token lists")
        metas = []
        for h, ids in zip(hashes, tokens, strict=True):
            ids = list(ids)
            if len(ids) != self.layout.block_size or hash_block(parent, ids) != h:
                raise ValueError(
                    f"block hash {h} is not the chained hash of its {len(ids)} token ids (only "
                    f"full blocks of {self.layout.block_size} tokens, hashed from parent {parent})"
                )
            metas.append(BlockMeta(h, parent, ids))
            parent = h
        return metas
