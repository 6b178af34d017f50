"""KVLayout: what a KV cache holds, block by block (K and V per KV head, or an MLA latent), and
which heads each rank of a tensor-parallel group has (the latent is one head, which every rank
holds whole: replicated, never split).

The handshake between a prefill and a decode worker (and the KV store's) compares layouts and
refuses a mismatch by naming the field. A tensor-parallel engine (`engine/tp/`) holds its KV
heads split over its ranks: a layout names the group's size and its rank (`tp_size`,
`tp_rank`), and each rank's caches hold that rank's heads. When the two groups split the heads
differently, `KVLayout.segments_from` says which of the sender's ranks and heads fill each of
the receiver's heads (re-sharding): the receiver still gets whole blocks of exactly its own
heads.

This module must stay importable without torch (the router imports `KVLayout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import msgspec

# Bytes per element of every cache dtype a layout may name (kept torch-free on purpose).
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}  # int8: model/kv_int8.py
CACHE_KINDS = ("heads", "latent")  # K and V per KV head; MLA's one latent per token and layer
_LAYOUT_FIELDS = (
    "model_fingerprint",
    "dtype",
    "num_layers",
    "block_size",
    "num_kv_heads",
    "head_dim",
)
# what two tensor-parallel groups must share for one to fill the other's heads
_MODEL_FIELDS = (
    "cache",
    "model_fingerprint",
    "dtype",
    "num_layers",
    "block_size",
    "model_kv_heads",
    "head_dim",
)


def kv_head_range(rank: int, size: int, kv_heads: int) -> range:
    """The model's KV heads that rank `rank` of a tensor-parallel group of `size` holds: an
    equal share when `size` divides them; one head, replicated on size/kv_heads ranks, when
    `size` is a multiple of them (as vLLM does). ValueError for other sizes."""
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside [0, {size})")
    if kv_heads % size == 0:
        per = kv_heads // size
        return range(rank * per, (rank + 1) * per)
    if size % kv_heads == 0:
        head = rank // (size // kv_heads)
        return range(head, head + 1)
    raise ValueError(
        f"a tensor-parallel size of {size} neither divides the model's {kv_heads} KV heads nor "
        "is a multiple of them"
    )


class HeadSegment(NamedTuple):
    """`count` consecutive KV heads a receiver gets from one rank of the sending group: the
    sender's rank `src_rank` heads from `src_head`, into the receiver's heads from `dst_head`
    (both numbered within their rank's cache)."""

    src_rank: int
    src_head: int
    dst_head: int
    count: int


class KVLayoutMismatch(ValueError):
    """Two workers' KV caches cannot exchange blocks; the message names every differing field."""


class KVLayout(msgspec.Struct, frozen=True):
    """Everything both sides must agree on before one block's bytes mean the same thing."""

    model_fingerprint: str
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1  # of the tensor-parallel group this cache belongs to
    tp_rank: int = 0  # whose cache this is (a group's sender: 0, and it reads every rank's)
    model_kv_heads: int = 0  # the model's KV heads, all ranks together; 0: num_kv_heads
    # "heads": a K and a V tensor per layer; "latent": MLA's one tensor per layer, of one
    # "head" of kv_lora_rank + qk_rope_head_dim (head_dim) values, whole on every rank
    cache: str = "heads"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"KV cache dtype {self.dtype!r} is not supported; use one of "
                f"{', '.join(DTYPE_SIZES)}"
            )
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"KVLayout.cache must be one of {CACHE_KINDS}, got {self.cache!r}")
        if self.cache == "latent" and self.heads_total != 1:
            raise ValueError(f"a latent KV cache has one head, not {self.heads_total}")
        for name in _LAYOUT_FIELDS[2:]:
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        held = len(self.heads)
        if held != self.num_kv_heads:
            raise ValueError(
                f"KVLayout: rank {self.tp_rank} of {self.tp_size} holds {held} of the model's "
                f"{self.heads_total} KV heads, not num_kv_heads={self.num_kv_heads}"
            )

    @property
    def heads(self) -> range:
        """The model's KV heads this rank's cache holds, in its order."""
        return kv_head_range(self.tp_rank, self.tp_size, self.heads_total)

    def shard(self, rank: int) -> KVLayout:
        """The layout of rank `rank` of this group."""
        return self.split(self.tp_size, rank)

    def split(self, size: int, rank: int = 0) -> KVLayout:
        """The layout of rank `rank` of a tensor-parallel group of `size` serving this model."""
        heads = self.heads_total
        return msgspec.structs.replace(
            self, tp_size=size, tp_rank=rank, model_kv_heads=heads,
            num_kv_heads=len(kv_head_range(rank, size, heads)),
        )  # fmt: skip

    @property
    def heads_total(self) -> int:
        """The model's KV heads, all ranks together."""
        return self.model_kv_heads or self.num_kv_heads

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def tensors(self) -> int:
        """Cache tensors per layer: 2 (K and V) or 1 (the latent)."""
        return 1 if self.cache == "latent" else 2

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer of K (or of V, or of the latent)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    def check_compatible(
        self, other: KVLayout, *, mine: str = "this worker", theirs: str = "peer"
    ) -> None:
        """Raise `KVLayoutMismatch` naming every field where `other` differs from `self`."""
        diffs = [
            f"{name}: {mine} has {_field(self, name)!r}, {theirs} has {_field(other, name)!r}"
            for name in _MODEL_FIELDS
            if _field(self, name) != _field(other, name)
        ]
        if diffs:
            raise KVLayoutMismatch(
                "KV layout mismatch between prefill and decode workers ("
                + "; ".join(diffs)
                + "). Start both workers with the same model, KV cache dtype and block size."
            )

    def segments_from(
        self, sender: KVLayout, *, mine: str = "decode worker", theirs: str = "prefill worker"
    ) -> list[HeadSegment]:
        """Where each of this rank's KV heads comes from in the sending group: its heads in
        order, each from the lowest sender rank holding it, merged into runs. Equal groups give
        one segment of rank `tp_rank`'s whole cache. KVLayoutMismatch when the model differs
        (`check_compatible`), or when the sender's group cannot be split as it says."""
        self.check_compatible(sender, mine=mine, theirs=theirs)
        try:
            owners = [sender.shard(r).heads for r in range(sender.tp_size)]
        except ValueError as exc:
            raise KVLayoutMismatch(
                f"the {theirs}'s tensor-parallel group cannot hold the model's KV heads: {exc}"
            ) from None
        segments: list[HeadSegment] = []
        for dst, head in enumerate(self.heads):
            rank = next(r for r, held in enumerate(owners) if head in held)
            src = head - owners[rank].start
            last = segments[-1] if segments else None
            if last and last.src_rank == rank and last.src_head + last.count == src:
                segments[-1] = last._replace(count=last.count + 1)
            else:
                segments.append(HeadSegment(rank, src, dst, 1))
        return segments


def _field(layout: KVLayout, name: str):
    return layout.heads_total if name == "model_kv_heads" else getattr(layout, name)


def whole_rank(segments: Sequence[HeadSegment], receiver: KVLayout, sender: KVLayout):
    """The sender rank whose blocks are the receiver's as they are (the same heads, in order),
    or None when the receiver's heads are gathered from slices of the sender's blocks."""
    if len(segments) != 1:
        return None
    seg = segments[0]
    src_heads = sender.shard(seg.src_rank).num_kv_heads
    if seg.src_head == 0 and seg.count == receiver.num_kv_heads == src_heads:
        return seg.src_rank
    return None
