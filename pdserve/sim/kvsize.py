"""`pdserve kv-size`: the KV-cache bytes of a prompt and its transfer time over each link."""

from __future__ import annotations

from pdserve.sim.hardware import LINKS, STANDARD_LINKS, Link, get_link
from pdserve.sim.kvmath import (
    format_bytes,
    format_duration,
    kv_bytes,
    kv_bytes_per_token,
    kv_shape_of,
    transfer_time,
)
from pdserve.sim.models import ModelSpec


def kv_size_report(model: ModelSpec, prompt_tokens: int, dtype: str, links: list[Link]) -> str:
    """The text `pdserve kv-size` prints: sizes, then one row per link."""
    per_token = kv_bytes_per_token(model, dtype)
    total = kv_bytes(model, prompt_tokens, dtype)
    if kv_shape_of(model).is_latent:
        shape = (
            f"MLA: {model.num_layers} layers x (latent {model.kv_lora_rank} + "
            f"RoPE key {model.qk_rope_head_dim}) x {dtype}"
        )
    else:
        shape = (
            f"{model.attention}: 2 x {model.num_layers} layers x {model.num_kv_heads} KV heads "
            f"x {model.head_dim} head_dim x {dtype}"
            + (" + a float32 scale a row" if dtype.lower() == "int8" else "")
        )
    lines = [
        f"model       {model.name} ({shape})",
        f"per token   {format_bytes(per_token)}",
        f"prompt      {prompt_tokens:,} tokens -> {format_bytes(total)}",
        "",
        f"{'link':<16} {'theoretical':>14} {'time':>10}   {'practical':>14} {'time':>10}",
    ]
    for link in links:
        t = transfer_time(total, link)
        lines.append(
            f"{link.name:<16} {link.theoretical_bytes_per_s / 1e9:>9.4g} GB/s "
            f"{format_duration(t.theoretical_s):>10}   "
            f"{link.practical_bytes_per_s / 1e9:>9.4g} GB/s {format_duration(t.practical_s):>10}"
        )
    lines.append("")
    lines.append("GB/s = 1e9 bytes/s; times include the link's per-message latency.")
    return "\n".join(lines)


def links_for(name: str | None, gbps: float | None) -> list[Link]:
    """The one link asked for (preset or --bandwidth-gbps), else every standard link."""
    if name and gbps:
        raise ValueError("give --link or --bandwidth-gbps, not both")
    if gbps is not None:
        return [Link.from_gbps(gbps)]
    if name:
        return [get_link(name)]
    return [LINKS[n] for n in STANDARD_LINKS]
