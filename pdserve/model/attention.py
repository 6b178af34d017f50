"""Paged attention over the block-structured KV cache, with metadata passed explicitly.

The flat batch holds decode tokens first (one per sequence, grouped by context length), then
prefill spans. Each decode group shares one attention call over a padded gather of its blocks;
each prefill span gets its own call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """Tokens [start, end) of the flat batch: one sequence's chunk at positions ending at
    context_len - 1. `fresh` means nothing of it is cached yet, so it attends to its own K/V."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor  # (num_blocks,) long
    fresh: bool


@dataclass
class DecodeGroup:
    """Decode tokens [start, end) of the flat batch, padded to their group's longest context."""

    start: int
    end: int
    block_tables: torch.Tensor  # (b, max_blocks) long
    mask: torch.Tensor  # (b, 1, 1, max_blocks * block_size) bool, True = attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) long: flat cache slot of every token
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    layer_hook: Callable[[int], None] | None = None  # called after each layer (KV streaming)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Blocks of one or more sequences laid end to end: (..., n_blocks * block_size, n_kv, d).
    index_select is ~5x faster than advanced indexing (cache[table]) on CPU."""
    flat = cache.index_select(0, block_table.reshape(-1))
    return flat.view(*block_table.shape[:-1], -1, *cache.shape[2:])


def _decode(q, k_cache, v_cache, tables, mask) -> torch.Tensor:
    """One query token per sequence. Two matmuls over the GQA-grouped queries: the CPU SDPA
    kernels are ~15x slower for a single bf16 query."""
    b, n_heads, d = q.shape
    n_kv = k_cache.shape[2]
    kd = _gather(k_cache, tables).transpose(1, 2)  # (B, n_kv, L, d)
    vd = _gather(v_cache, tables).transpose(1, 2)
    qg = q.view(b, n_kv, n_heads // n_kv, d)  # head h reads kv head h // group, as enable_gqa
    scores = torch.matmul(qg, kd.transpose(-1, -2)).float() * d**-0.5  # (B, n_kv, group, L)
    scores = scores.masked_fill(~mask, float("-inf"))  # mask (B, 1, 1, L)
    return torch.matmul(scores.softmax(-1).to(q.dtype), vd).view(b, n_heads, d)


def paged_attention(
    q: torch.Tensor,  # (T, n_heads, d)
    k: torch.Tensor,  # (T, n_kv, d)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # (num_blocks, block_size, n_kv, d)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Writes k/v into the cache at meta.slot_mapping, returns attention output (T, n_heads, d)."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        out[g.start : g.end] = _decode(q[g.start : g.end], k_cache, v_cache, g.block_tables, g.mask)
    for span in meta.prefills:
        # 4-D tensors: with 3-D ones torch's CPU dispatcher falls back to the math kernel,
        # which materializes every score (6x slower at 2,048 tokens).
        qs = q[span.start : span.end].transpose(0, 1)[None]  # (1, n_heads, n, d)
        if span.fresh:
            ks = k[span.start : span.end].transpose(0, 1)[None]  # (1, n_kv, n, d)
            vs = v[span.start : span.end].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            ctx, n = span.context_len, span.end - span.start
            ks = _gather(k_cache, span.block_table)[:ctx].transpose(0, 1)[None]  # (1, n_kv, ctx, d)
            vs = _gather(v_cache, span.block_table)[:ctx].transpose(0, 1)[None]
            q_pos = torch.arange(ctx - n, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # (n, ctx)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        out[span.start : span.end] = o[0].transpose(0, 1)
    return out
