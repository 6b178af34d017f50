"""What the KV cache holds per token and layer: K and V for each KV head, or multi-head latent
attention's one latent (DeepSeek-V2/V3: the compressed KV of `kv_lora_rank` values and the RoPE
key of `qk_rope_head_dim` values that every head shares).

One function for every place that sizes a cache: the engine's cache tensors
(`engine/model_runner.py`), the KV layout the workers exchange, and the planner's arithmetic
(`sim/kvmath.py`). Kept torch-free: the router and the planner import it.
"""

from __future__ import annotations

from typing import NamedTuple


class KVShape(NamedTuple):
    """Per token and layer: `tensors` cache tensors (2: K and V; 1: the MLA latent), each of
    `heads` heads (this rank's KV heads; 1 for the latent) of `dim` values."""

    tensors: int
    heads: int
    dim: int

    @property
    def is_latent(self) -> bool:
        return self.tensors == 1

    @property
    def elements(self) -> int:
        """Cached values per token and layer."""
        return self.tensors * self.heads * self.dim


def kv_shape(
    num_kv_heads: int, head_dim: int, kv_lora_rank: int = 0, qk_rope_head_dim: int = 0
) -> KVShape:
    """K and V of `num_kv_heads` heads of `head_dim`; or, where `kv_lora_rank` is set (MLA),
    one latent of kv_lora_rank + qk_rope_head_dim values, the same on every tensor-parallel
    rank (it is not split by heads)."""
    if kv_lora_rank:
        return KVShape(1, 1, kv_lora_rank + qk_rope_head_dim)
    return KVShape(2, num_kv_heads, head_dim)
