"""The 8-bit KV cache (`--kv-cache-dtype int8`): each (token, KV head) row of K or V, head_dim
values, is kept as head_dim int8 values and their float32 scale in the same row (amax / 127,
the four bytes after the values). A layer's cache stays one tensor each for K and V, of dtype
int8 and last dimension head_dim + 4, so every block mover (the KV fabric, the KV store, the
staging copies) moves it as bytes unchanged, and a block holds the same tokens in about half
the bytes of a bfloat16 one: twice the tokens in the same memory, and half the bytes a decode
step's attention reads (the most of a big batch's step on CPU).

Rows are quantized as they are written, by the same arithmetic everywhere (`quantize`; the
extension's `write_kv` for a prefill's rows and the fused decode step's write give its bytes
for the same values, though the fused step's K may differ from eager's in its last bit: its
RoPE rounds once), and read back as values times their scale: by the fused step's int8
attention, and by `dequantize` for eager attention and prompt chunks over cached prefixes. A
fresh prompt's own attention uses its unquantized K/V, as vLLM's fp8 cache does.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # the row's float32 scale, after its values


def row_width(head_dim: int) -> int:
    """Bytes of one quantized row of `head_dim` values."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows (..., d) of any float dtype -> (..., d + 4) int8: round(x / s) and s = amax / 127
    (1 for a row of zeros) as float32 bytes. Division and rounding half to even, in float32,
    as the extension's writes (csrc/decode.cpp `quantize_kv_row`)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(xf / scale).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], -1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantized rows (..., d + 4) -> values (..., d) in `dtype`."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # (..., 1)
    return (rows[..., :d].float() * scale).to(dtype)
