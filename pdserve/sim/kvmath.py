"""KV-cache size and transfer-time arithmetic (the seeds' "KV transfer" math).

    KV bytes = 2 (K and V) x layers x KV heads x head_dim x tokens x bytes per element

GQA and MQA enter through the KV head count. MLA (DeepSeek) caches one compressed latent of
`kv_lora_rank` plus a shared RoPE key of `qk_rope_head_dim` per token and layer instead of
per-head K and V. Sizes are exact integers (int4 is half a byte, so counts stay whole for the
even element counts every real model has). int8 is pdserve's 8-bit cache (`--kv-cache-dtype
int8`, model/kv_int8.py): each (token, KV head) row of K or V carries its float32 scale after
its values, 4 bytes more a row (6 % at head_dim 64).
"""

from __future__ import annotations

from typing import NamedTuple

from pdserve.model.kv_shape import KVShape, kv_shape
from pdserve.sim.hardware import Link
from pdserve.sim.models import ModelSpec

# Bits per element, so int4 stays exact in integer arithmetic.
INT8_SCALE_BYTES = 4  # model/kv_int8.py SCALE_BYTES (that module imports torch; this one may not)
DTYPE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}
_DTYPE_ALIASES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16"}


def dtype_bits(dtype: str) -> int:
    """Bits per element of `dtype` (fp32, fp16, bf16, fp8, int8, int4; torch names accepted)."""
    key = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if key not in DTYPE_BITS:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BITS)}")
    return DTYPE_BITS[key]


def kv_dtype_of(weight_dtype: str) -> str:
    """The KV cache's dtype when only the weights' is known: the same, except for integer
    weight formats (pdserve's int8/int4 linear layers, like AWQ/GPTQ engines, keep a 16-bit
    cache)."""
    return "bf16" if weight_dtype in ("int8", "int4") else weight_dtype


def kv_shape_of(model: ModelSpec) -> KVShape:
    """What the cache holds per token and layer (K and V per KV head, or MLA's latent + RoPE
    key): the engine's own function (`model/kv_shape.py`, which sizes its cache tensors)."""
    return kv_shape(model.num_kv_heads, model.head_dim, model.kv_lora_rank or 0,
                    model.qk_rope_head_dim or 0)  # fmt: skip


def kv_elements_per_token(model: ModelSpec) -> int:
    """Cached elements per token over all layers."""
    return model.num_layers * kv_shape_of(model).elements


def _scale_bytes_per_token(model: ModelSpec, dtype: str) -> int:
    """The int8 cache's row scales a token adds across all layers (K and V per KV head)."""
    shape = kv_shape_of(model)
    if dtype.lower() != "int8" or shape.is_latent:
        return 0
    return model.num_layers * 2 * model.num_kv_heads * INT8_SCALE_BYTES


def kv_bytes_per_token(model: ModelSpec, dtype: str = "fp16") -> int:
    """KV-cache bytes one token adds across all layers."""
    values = kv_elements_per_token(model) * dtype_bits(dtype) // 8
    return values + _scale_bytes_per_token(model, dtype)


def kv_bytes(model: ModelSpec, tokens: int, dtype: str = "fp16") -> int:
    """KV-cache bytes of a `tokens`-long prompt; ValueError for negative lengths."""
    if tokens < 0:
        raise ValueError(f"prompt length must be >= 0 tokens, got {tokens}")
    values = kv_elements_per_token(model) * tokens * dtype_bits(dtype) // 8
    return values + _scale_bytes_per_token(model, dtype) * tokens


class TransferTime(NamedTuple):
    """Seconds to move some bytes over a link at its theoretical and practical bandwidth."""

    theoretical_s: float
    practical_s: float


def transfer_time(num_bytes: int, link: Link) -> TransferTime:
    """Time to send `num_bytes` over `link`: bytes / bandwidth (+ the link's latency)."""
    return TransferTime(
        link.latency_s + num_bytes / link.theoretical_bytes_per_s,
        link.latency_s + num_bytes / link.practical_bytes_per_s,
    )


def format_bytes(n: int) -> str:
    """Exact bytes plus decimal (kB/MB/GB) and binary (KiB/MiB/GiB) forms, e.g. for 1,342,177,280:
    "1,342,177,280 B = 1.342 GB = 1.250 GiB = 1,310,720 KiB" (the seeds mix both conventions).
    """
    dec = _scaled(n, 1000, ("B", "kB", "MB", "GB", "TB"))
    binary = _scaled(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB"))
    kib = f" = {n / 1024:,.0f} KiB" if n >= 1024**2 and n % 1024 == 0 else ""
    return f"{n:,} B = {dec} = {binary}{kib}"


def _scaled(n: float, base: int, units: tuple[str, ...]) -> str:
    value, unit = float(n), units[0]
    for unit in units:
        if value < base or unit == units[-1]:
            break
        value /= base
    return f"{value:,.3f} {unit}" if unit != units[0] else f"{n:,} {unit}"


def format_duration(seconds: float) -> str:
    """Milliseconds with sensible precision: 0.30 ms, 10.7 ms, 122.0 ms, 1.52 s."""
    ms = seconds * 1e3
    if ms < 10:
        return f"{ms:.2f} ms"
    if ms < 1000:
        return f"{ms:.1f} ms"
    return f"{seconds:.2f} s"
