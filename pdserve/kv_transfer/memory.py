"""Views of the engine's KV cache memory that connectors read and write in place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from pdserve.kv_transfer.layout import HeadSegment, KVLayout


class Run(NamedTuple):
    """`count` consecutive blocks from `src` in the source and from `dst` in the destination."""

    src: int
    dst: int
    count: int


def layout_of(
    model_fingerprint: str, k_caches: Sequence[torch.Tensor], latent: bool = False
) -> KVLayout:
    """The KVLayout describing an engine's caches (shape [num_blocks, block, heads, dim]);
    `latent`: `k_caches` are MLA latent caches (and there are no V caches)."""
    _, block_size, heads, dim = k_caches[0].shape
    dtype = str(k_caches[0].dtype).removeprefix("torch.")
    cache = "latent" if latent else "heads"
    return KVLayout(model_fingerprint, dtype, len(k_caches), block_size, heads, dim, cache=cache)


def layer_caches(k_caches: Sequence, v_caches: Sequence, layer: int) -> tuple:
    """The cache tensors (or their views) of one layer, in wire order: K then V, or the latent
    alone (an MLA cache: `v_caches` empty)."""
    return (k_caches[layer], v_caches[layer]) if v_caches else (k_caches[layer],)


def check_caches(
    layout: KVLayout, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]
) -> int:
    """Check the caches match `layout` (and are contiguous CPU tensors); return num_blocks."""
    v_layers = layout.num_layers if layout.tensors == 2 else 0  # a latent cache has no V
    if len(k_caches) != layout.num_layers or len(v_caches) != v_layers:
        what = "latent cache tensors and no V" if v_layers == 0 else "K and V cache tensors"
        raise ValueError(
            f"expected {layout.num_layers} {what} (one per layer), got {len(k_caches)} and "
            f"{len(v_caches)}"
        )
    num_blocks = k_caches[0].shape[0]
    want = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    for t in (*k_caches, *v_caches):
        if tuple(t.shape) != want or str(t.dtype) != f"torch.{layout.dtype}":
            raise ValueError(
                f"KV cache tensor has shape {tuple(t.shape)} and dtype {t.dtype}; the layout "
                f"needs {want} and {layout.dtype}"
            )
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("KV cache tensors must be contiguous CPU tensors")
    return num_blocks


def byte_views(caches: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Per layer, a uint8 numpy view [num_blocks, block_bytes] sharing the tensor's memory.

    bfloat16 has no numpy dtype, so the tensor is reinterpreted as bytes before `.numpy()`.
    """
    return [t.view(torch.uint8).reshape(t.shape[0], -1).numpy() for t in caches]


def check_block_ids(ids: Sequence[int], num_blocks: int, what: str) -> None:
    """Raise ValueError if an id is out of [0, num_blocks) or repeated."""
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{what} block ids {bad[:8]} are outside [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} block ids repeat: {list(ids)[:16]}")


def check_layer_blocks(src_ids: Sequence[int], dst_ids: Sequence[int], num_blocks: int) -> None:
    """A `send_layer`'s ids: as many destinations as sources, sources in [0, num_blocks) once."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    check_block_ids(src_ids, num_blocks, "source")


def paired_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[Run]:
    """Group block pairs into runs consecutive on both sides, so each run is one span per side."""
    runs: list[Run] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1].src + runs[-1].count == s and runs[-1].dst + runs[-1].count == d:
            runs[-1] = runs[-1]._replace(count=runs[-1].count + 1)
        else:
            runs.append(Run(s, d, 1))
    return runs


def gather_heads(
    caches: Sequence[Sequence[torch.Tensor]],
    layer: int,
    ids: Sequence[int],
    segments: Sequence[HeadSegment],
    heads: int,
) -> torch.Tensor:
    """Blocks `ids` of layer `layer` as a receiver of `heads` KV heads holds them, gathered from
    the sending group's ranks (`caches[rank]`: that rank's per-layer caches) by `segments`:
    a new contiguous tensor [len(ids), block_size, heads, head_dim] (re-sharding)."""
    index = torch.tensor(list(ids), dtype=torch.long)
    first = caches[0][layer]
    out = first.new_empty((len(ids), first.shape[1], heads, first.shape[3]))
    for s in segments:
        blocks = caches[s.src_rank][layer].index_select(0, index)
        src, dst = slice(s.src_head, s.src_head + s.count), slice(s.dst_head, s.dst_head + s.count)
        out[:, :, dst] = blocks[:, :, src]
    return out
