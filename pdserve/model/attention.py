"""Paged attention over the block-structured KV cache, with metadata passed explicitly.

The flat batch holds decode tokens first (one per sequence, grouped by context length), then
prefill spans. Each decode group shares one attention call over a padded gather of its blocks;
each prefill span gets its own call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model import kv_int8
from pdserve.model.extension import eager_kernels


@dataclass
class PrefillSpan:
    """Tokens [start, end) of the flat batch: one sequence's chunk at positions ending at
    context_len - 1. `fresh` means nothing of it is cached yet, so it attends to its own K/V;
    `prompt` that the chunk computes prompt tokens (not a verify step's proposals)."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor  # (num_blocks,) long
    fresh: bool
    prompt: bool = True


@dataclass
class DecodeGroup:
    """Decode tokens [start, end) of the flat batch, padded to their group's longest context."""

    start: int
    end: int
    block_tables: torch.Tensor  # (b, max_blocks) long
    mask: torch.Tensor  # (b, 1, 1, max_blocks * block_size) bool, True = attend (the window's
    # positions only, for sliding-window attention: `ModelRunner._decode_groups`)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) long: flat cache slot of every token
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    layer_hook: Callable[[int], None] | None = None  # called after each layer (KV streaming)
    before_layer: Callable[[int], None] | None = None  # called before each (KV arriving)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Blocks of one or more sequences laid end to end: (..., n_blocks * block_size, n_kv, d).
    index_select is ~5x faster than advanced indexing (cache[table]) on CPU."""
    flat = cache.index_select(0, block_table.reshape(-1))
    return flat.view(*block_table.shape[:-1], -1, *cache.shape[2:])


def write_kv(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Rows x (T, n_kv, d) into the cache at their flat slots: as they are, or quantized into
    an 8-bit cache (`kv_int8`). A prefill's bf16 rows on CPU go through the extension's
    `write_kv` (both threads, the same bytes), the rest through torch."""
    if (ext := eager_kernels(x)) is not None and cache.is_contiguous():
        ext.write_kv(x, cache, slots)
        return
    rows = kv_int8.quantize(x) if cache.dtype == torch.int8 else x
    cache.view(-1, *rows.shape[1:]).index_copy_(0, slots, rows)


def read_blocks(cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype):
    """`gather_blocks`, as values in `dtype`: an 8-bit cache's rows dequantized
    (`kv_int8`)."""
    rows = gather_blocks(cache, block_table)
    return kv_int8.dequantize(rows, dtype) if cache.dtype == torch.int8 else rows


def _decode(q, k_cache, v_cache, tables, mask) -> torch.Tensor:
    """One query token per sequence. Two matmuls over the GQA-grouped queries: the CPU SDPA
    kernels are ~15x slower for a single bf16 query."""
    b, n_heads, d = q.shape
    n_kv = k_cache.shape[2]
    kd = read_blocks(k_cache, tables, q.dtype).transpose(1, 2)  # (B, n_kv, L, d)
    vd = read_blocks(v_cache, tables, q.dtype).transpose(1, 2)
    qg = q.view(b, n_kv, n_heads // n_kv, d)  # head h reads kv head h // group, as enable_gqa
    scores = torch.matmul(qg, kd.transpose(-1, -2)).float() * d**-0.5  # (B, n_kv, group, L)
    scores = scores.masked_fill(~mask, float("-inf"))  # mask (B, 1, 1, L)
    return torch.matmul(scores.softmax(-1).to(q.dtype), vd).view(b, n_heads, d)


# Prefill spans of at least this many queries, in bfloat16 on CPU, use `prompt_causal` (the C++
# kernel, or `_blockwise_causal`); the rest use torch's SDPA. Measured (1 thread, SmolLM2 shapes,
# AVX512-BF16 without AMX), blockwise time / SDPA time: 0.95 at 128 queries, 0.5 at 512, 0.53 at
# 2,048 (45 vs 85 ms); below 128 its fixed Python cost (~0.2 ms per call) loses. In float32 both
# take the same time (SDPA kept). The default only: an engine on CPU measures where its own
# kernel wins on its machine (`kernel_rows.KernelRows.prompt_kernel_queries`: on a Xeon with
# AMX, from 128 to 1,024 queries; SDPA's flash loop wins longer chunks) and sets each layer's
# `kernel_queries`.
BLOCKWISE_MIN_QUERIES = 128
KERNEL_QUERIES = (BLOCKWISE_MIN_QUERIES, 1 << 30)  # (first, last): the default range
# Query positions per block. 128 x group 3 = 384 score rows per matmul: big enough for the
# matmuls to run near peak, small enough that a block's scores (<= 1.5 MiB at 2,048 keys) stay in
# cache between the two matmuls and the softmax. Measured at 2,048 tokens: 45 ms per layer at
# 128, 46-48 ms at 64, 96, 192 and 256.
QUERY_BLOCK = 128


@functools.lru_cache(maxsize=32)
def _diagonal_bias(
    block: int, group: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Additive causal mask of a diagonal block: (block * group, block), row r is query position
    r // group (the GQA heads of one position are adjacent rows); 0 = attend, -inf = future."""
    pos = torch.arange(block, device=device).repeat_interleave(group)
    future = torch.arange(block, device=device)[None, :] > pos[:, None]
    return torch.zeros(future.shape, dtype=dtype, device=device).masked_fill_(future, float("-inf"))


def _blockwise_causal(q, k, v, dest: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the last n = len(q) positions of a context of L = len(k) keys:
    q (n, n_heads, d), k/v (L, n_kv, d) -> (n, n_heads, d), written into `dest` if given; query
    i sits at position L - n + i.

    CPU SDPA runs bf16 causal attention at ~60 GFLOP/s on one core; plain bf16 matmuls reach
    ~200. Per kv head, the queries of its GQA group are the M dimension (group x 128 rows per
    block), and each query block multiplies only the keys up to its last position, so the upper
    triangle is skipped except inside the diagonal block, which gets an additive -inf mask. As in
    transformers' eager attention, scores are rounded to the input dtype and the softmax runs in
    float32 internally."""
    n, n_heads, d = q.shape
    L, n_kv = k.shape[:2]
    group, offset = n_heads // n_kv, L - n
    # (n_kv, n * group, d): one kv head's query rows, position-major. The scale is applied here,
    # once per query, not per score (exact in bf16 when it is a power of two, as for d = 64).
    qh = torch.empty(n_kv, n, group, d, dtype=q.dtype, device=q.device)
    torch.mul(q.view(n, n_kv, group, d).transpose(0, 1), d**-0.5, out=qh)
    qh = qh.view(n_kv, n * group, d)
    kh = k.transpose(0, 1).contiguous()  # (n_kv, L, d): row slices are plain matrices
    vh = v.transpose(0, 1).contiguous()
    out = torch.empty_like(qh)
    block = min(QUERY_BLOCK, n)
    bias = _diagonal_bias(block, group, q.dtype, q.device)  # its top-left corner fits a short block
    scores = torch.empty(block * group * L, dtype=q.dtype, device=q.device)  # reused per block
    for qj, kj, vj, oj in zip(qh, kh, vh, out, strict=True):  # per kv head
        for i0 in range(0, n, block):
            i1 = min(i0 + block, n)
            keys, r0, r1 = offset + i1, i0 * group, i1 * group
            s = scores[: (r1 - r0) * keys].view(r1 - r0, keys)
            torch.mm(qj[r0:r1], kj[:keys].t(), out=s)
            s[:, offset + i0 :].add_(bias[: r1 - r0, : i1 - i0])
            torch._softmax(s, -1, False, out=s)  # in place: no second score-sized buffer
            torch.mm(s, vj[:keys], out=oj[r0:r1])
    dest = torch.empty_like(q) if dest is None else dest
    dest.view(n, n_kv, group, d).copy_(out.view(n_kv, n, group, d).transpose(0, 1))
    return dest


def _prompt_kernel(q: torch.Tensor):
    """The C++ extension, where its causal attention of a prompt's chunk runs q in place of
    `_blockwise_causal` (the same rounding; shorter chunks keep SDPA's float scores): bf16 on CPU,
    a build with AVX512-BF16, head_dim 32, 64 or 128 (csrc/prefill_attention.h; Zen 4, 2
    threads, against `_blockwise_causal`: 2.4x at 256 tokens, 1.5x at 1,000, 1.2x for the last
    1,024 of 2,048); else None. Only once the extension is loaded (int4/int8 weights and the
    fused decode step load it at start): an eager prefill never waits on its build."""
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or q.shape[-1] not in (32, 64, 128):
        return None
    from pdserve.model.extension import loaded_or_none

    ext = loaded_or_none()
    return ext if ext is not None and ext.bf16_attention() else None


def _use_blockwise(q: torch.Tensor, kernel_queries: tuple[int, int]) -> bool:
    first, last = kernel_queries
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and first <= q.shape[0] <= last


def prompt_causal(q, k, v, dest: torch.Tensor | None = None) -> torch.Tensor:
    """`_blockwise_causal`, by the C++ kernel where it runs (the same bits), into `dest`."""
    if (ext := _prompt_kernel(q)) is None:
        return _blockwise_causal(q, k, v, dest=dest)
    out = ext.prefill_attention(q, k, v)
    return out if dest is None else dest.copy_(out)


def paged_attention(
    q: torch.Tensor,  # (T, n_heads, d)
    k: torch.Tensor,  # (T, n_kv, d)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # (num_blocks, block_size, n_kv, d)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None = None,
    kernel_queries: tuple[int, int] = KERNEL_QUERIES,
) -> torch.Tensor:
    """Writes k/v into the cache at meta.slot_mapping, returns attention output (T, n_heads, d).
    `window`: sliding-window attention, each query attends to the last `window` positions (itself
    included), as transformers' sliding_window_overlay; decode groups carry it in their mask.
    `kernel_queries`: prompt chunks of [first, last] queries run `prompt_causal`, others
    torch's SDPA (bf16 on CPU; see BLOCKWISE_MIN_QUERIES). An int8 cache (`kv_int8`) takes
    the rows quantized and gives them back dequantized."""
    write_kv(k, k_cache, meta.slot_mapping)
    write_kv(v, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        out[g.start : g.end] = _decode(q[g.start : g.end], k_cache, v_cache, g.block_tables, g.mask)
    for span in meta.prefills:
        qs = q[span.start : span.end]
        if span.fresh:
            ks, vs = k[span.start : span.end], v[span.start : span.end]  # (n, n_kv, d)
        else:
            ctx = span.context_len  # the keys (ctx, n_kv, d) of every cached position
            ks = read_blocks(k_cache, span.block_table, q.dtype)[:ctx]
            vs = read_blocks(v_cache, span.block_table, q.dtype)[:ctx]
        if window is not None and span.context_len > window:
            out[span.start : span.end] = sdpa_causal(qs, ks, vs, window)
        elif _use_blockwise(qs, kernel_queries):
            prompt_causal(qs, ks, vs, dest=out[span.start : span.end])
        else:
            out[span.start : span.end] = sdpa_causal(qs, ks, vs)
    return out


def sdpa_causal(q, k, v, window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """As `_blockwise_causal`, with torch's SDPA; `window`: only the last `window` positions;
    `scale`: the softmax scale (None: head_dim ** -0.5). v's head width may differ from q's."""
    n, ctx = q.shape[0], k.shape[0]
    # 4-D tensors: with 3-D ones torch's CPU dispatcher falls back to the math kernel, which
    # materializes every score (6x slower at 2,048 tokens).
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, heads, len, d)
    if n == ctx and window is None:  # a fresh prompt: plain causal
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True, scale=scale)
    else:  # queries are the last n positions: is_causal would align them with the first keys
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        mask = k_pos <= q_pos  # (n, ctx)
        if window is not None:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True, scale=scale)
    return o[0].transpose(0, 1)
