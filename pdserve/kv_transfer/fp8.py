"""Optional on-the-wire compression of KV blocks to FP8 (e4m3) with one float32 scale per block.

Lossy (e4m3 keeps 3 mantissa bits: relative error up to 1/16 of each block's range steps), off by
default, and only worth it when the network, not the CPU, is the bottleneck: it halves the bytes
of bfloat16/float16 caches and quarters float32 ones, at the price of a gather + quantize on the
sender and a staging buffer + dequantize on the receiver (no longer zero-copy).

Payload of one layer: for K then V (or the MLA latent alone), `n` float32 scales followed by
`n` blocks of FP8 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.kv_transfer.layout import KVLayout

ENCODING = "fp8"
_E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def block_elems(layout: KVLayout) -> int:
    return layout.block_size * layout.num_kv_heads * layout.head_dim


def payload_bytes(layout: KVLayout, num_blocks: int) -> int:
    """Bytes of one layer's K and V (or latent) payload for `num_blocks` blocks."""
    return layout.tensors * num_blocks * (4 + block_elems(layout))


def encode(cache: torch.Tensor, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales float32 [n], fp8 bytes uint8 [n, block_elems]) of blocks `ids` of one cache."""
    x = cache[list(ids)].float().reshape(len(ids), -1)  # (n, block_size*heads*dim)
    scales = (x.abs().amax(dim=1) / _E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (x / scales[:, None]).to(torch.float8_e4m3fn)
    return scales, q.view(torch.uint8)


def decode_into(
    cache: torch.Tensor, ids: Sequence[int], scales: torch.Tensor, data: torch.Tensor
) -> None:
    """Write the dequantized blocks into `cache[ids]` (uint8 `data` [n, block_elems])."""
    x = data.view(torch.float8_e4m3fn).float() * scales[:, None]
    cache[list(ids)] = x.reshape(len(ids), *cache.shape[1:]).to(cache.dtype)


def split_payload(buf: bytearray, layout: KVLayout, n: int) -> list[tuple[torch.Tensor, ...]]:
    """Views [(k_scales, k_data), (v_scales, v_data)] (or the latent's one pair) into a
    received layer payload."""
    elems, parts, off = block_elems(layout), [], 0
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    for _ in range(layout.tensors):
        scales = flat[off : off + 4 * n].view(torch.float32)
        off += 4 * n
        parts.append((scales, flat[off : off + n * elems].view(n, elems)))
        off += n * elems
    return parts
