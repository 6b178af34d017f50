"""RoPE frequencies with the scalings the served families' configs use: "llama3"
(frequency-dependent), "yarn" (Qwen's long-context setting: a ramp between interpolated and
extrapolated frequencies, and an attention factor on cos/sin), "linear" (positions / factor).
Each matches transformers' `modeling_rope_utils` for the same parameters."""

from __future__ import annotations

import math

import numpy as np
import torch

from pdserve.config import RopeScaling
from pdserve.model.extension import eager_kernels


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None, freq_factors: np.ndarray | None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim / 2,) float32, the factor cos and sin are scaled by)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:  # GGUF's rope_freqs tensor: llama.cpp divides by it
        return (inv / torch.from_numpy(freq_factors).to(torch.float64)).float(), 1.0
    if scaling is None:
        return inv.float(), 1.0
    if scaling.rope_type == "linear":
        return (inv / scaling.factor).float(), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    # llama3: scale low frequencies, keep high ones, blend between
    low_wl = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wl = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = torch.where(wavelen > low_wl, inv / scaling.factor, inv)
    mid = (wavelen <= low_wl) & (wavelen >= high_wl)
    return torch.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled).float(), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction of a context `scale`d up (1 when not scaled up)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    factor = s.factor
    if s.attention_factor is not None:
        attn = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attn = yarn_mscale(factor, s.mscale) / yarn_mscale(factor, s.mscale_all_dim)
    else:
        attn = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = s.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin in three ops: `sin` carries rotate_half's sign
    (`LlamaModel` builds cos and sin so)."""
    ext = eager_kernels(x)
    if (
        ext is not None
        and x.dim() == 3
        and x.shape[2] % 32 == 0
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cos.shape == (x.shape[0], 1, x.shape[2])
        and cos.dtype == x.dtype
    ):
        return ext.rope(x, cos, sin)  # a bf16 prefill's rows in one pass, the same rounding
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], -1)
    return torch.addcmul(x * cos, swapped, sin)
