"""Factories for KV store tests: token chains, configs, in-process stores and servers."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from kv_transfer.helpers import HAS_NIXL, NIXL_SKIP, make_caches, make_layout

from pdserve.engine.block_hash import block_hashes
from pdserve.kv_store.config import Key, StoreConfig, layout_key, payload_bytes
from pdserve.kv_store.protocol import BlockMeta
from pdserve.kv_store.server import StoreServer
from pdserve.kv_store.store import Store
from pdserve.kv_transfer.layout import KVLayout

__all__ = ["make_caches", "make_layout"]
NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not HAS_NIXL, reason=NIXL_SKIP))
TRANSPORTS = ["tcp", NIXL]
both_transports = pytest.mark.parametrize("transport", TRANSPORTS)  # the `serve` fixture's


class Chain(NamedTuple):
    """`n` full blocks of one sequence: their chained hashes and token ids."""

    hashes: list[int]
    tokens: list[list[int]]

    def metas(self) -> list[BlockMeta]:
        parents = [None, *self.hashes[:-1]]
        return [
            BlockMeta(h, p, t) for h, p, t in zip(self.hashes, parents, self.tokens, strict=True)
        ]


def make_chain(n: int, block_size: int = 4, first_token: int = 100) -> Chain:
    tokens = list(range(first_token, first_token + n * block_size))
    split = [tokens[i * block_size : (i + 1) * block_size] for i in range(n)]
    return Chain(block_hashes(tokens, block_size), split)


def make_config(path: Path, layout: KVLayout, dram_blocks: int, ssd_blocks: int, **kw):
    """Capacities counted in blocks (SSD: in files of this layout, which are a bit larger)."""
    fields = dict(high_watermark=1.0, low_watermark=1.0)
    return StoreConfig(
        dram_bytes=dram_blocks * payload_bytes(layout),
        ssd_bytes=ssd_blocks * file_bytes(layout),
        store_dir=path,
        **{**fields, **kw},
    )


def file_bytes(layout: KVLayout) -> int:
    """The largest size of a block file of `layout` with make_chain's token ids (a first
    block, whose parent is None, is 8 bytes smaller in msgpack)."""
    from pdserve.kv_store.ssd import SsdFiles

    meta = BlockMeta(2**62, 2**62, list(range(100, 100 + layout.block_size)))
    head = SsdFiles.encode_head(layout, meta, payload_bytes(layout))
    return SsdFiles.file_size(head, payload_bytes(layout))


def payload_of(k, v, block: int) -> bytes:
    """One block of caches as the store keeps it: K0 V0 K1 V1 ..."""
    return b"".join(
        bytes(t[block].contiguous().view(torch.uint8).numpy())
        for pair in zip(k, v, strict=True)
        for t in pair
    )


def fill(store: Store, layout: KVLayout, chain: Chain, caches, blocks=None) -> list[Key]:
    """Put chain's blocks (payload from `caches` block i) straight into `store`."""
    keys = [Key(layout_key(layout), h) for h in chain.hashes]
    for i, (key, meta) in enumerate(zip(keys, chain.metas(), strict=True)):
        assert store.put(key, layout, meta, payload_of(*caches, i if blocks is None else blocks[i]))
    return keys


class Served(NamedTuple):
    store: Store
    server: StoreServer


def _mooncake_missing() -> str | None:
    from pdserve.kv_store.mooncake_setup import import_mooncake

    try:
        import_mooncake()
    except ImportError as exc:
        return f"Mooncake unavailable: {exc}"
    return None


MOONCAKE_SKIP = _mooncake_missing()  # None where the wheel and libibverbs1 load
