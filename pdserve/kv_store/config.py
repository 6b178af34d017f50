"""The store's configuration and the key of a block: (layout key, chained block hash)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from pdserve.kv_transfer.layout import KVLayout

GB = 1 << 30


class Key(NamedTuple):
    """One stored block: which cache layout its bytes are in, and its chained block hash."""

    layout_key: str
    block_hash: int


def layout_key(layout: KVLayout) -> str:
    """16 hex digits naming a layout; blocks of different layouts never share a key."""
    h = hashlib.blake2b(digest_size=8)
    for field in layout.__struct_fields__:
        h.update(f"{field}={getattr(layout, field)!r};".encode())
    return h.hexdigest()


def payload_bytes(layout: KVLayout) -> int:
    """Bytes of one stored block: K and V (or the MLA latent) of every layer."""
    return layout.tensors * layout.num_layers * layout.block_bytes


@dataclass(frozen=True)
class StoreConfig:
    """Capacities in bytes, the SSD directory and the DRAM watermarks.

    When DRAM holds more than `high_watermark * dram_bytes`, least recently used blocks are
    demoted to SSD until it holds at most `low_watermark * dram_bytes`. The SSD tier never holds
    more than `ssd_bytes` of files: the least recently used are deleted first. `ssd_bytes=0`
    turns the SSD tier off (demotion then deletes). `verify_on_start` checksums every file at
    startup instead of only at first read (every read is checksummed either way).
    """

    dram_bytes: int
    ssd_bytes: int
    store_dir: Path
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    verify_on_start: bool = False
    max_connections: int = 256
    max_lease_s: float = 60.0

    def __post_init__(self) -> None:
        if self.dram_bytes < 0 or self.ssd_bytes < 0:
            raise ValueError("store capacities must be >= 0 (use --dram-gb 0 for SSD only)")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError(
                f"watermarks must satisfy 0 < low <= high <= 1, got low={self.low_watermark} "
                f"high={self.high_watermark}"
            )
        if self.max_connections < 1 or self.max_lease_s <= 0:
            raise ValueError("max_connections must be >= 1 and max_lease_s > 0")

    @property
    def dram_high_bytes(self) -> int:
        return int(self.dram_bytes * self.high_watermark)

    @property
    def dram_low_bytes(self) -> int:
        return int(self.dram_bytes * self.low_watermark)
