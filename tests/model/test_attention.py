"""The blockwise causal prefill kernel against torch's SDPA, for fresh prompts and for the last
queries of a longer context (chunked prefill, prefix-cache hits)."""

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import attention
from pdserve.model.attention import _blockwise_causal


def reference(q, k, v):
    """SDPA in float32: queries are the last len(q) of len(k) positions."""
    n, ctx = q.shape[0], k.shape[0]
    q4, k4, v4 = (x.float().transpose(0, 1)[None] for x in (q, k, v))
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)


def inputs(n, ctx, heads, kv_heads, dtype, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    k = torch.randn(ctx, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(ctx, kv_heads, d, generator=g).to(dtype)
    return q, k, v


# (queries, context, heads, kv heads): fresh prompts (n == ctx) and chunks at the end of a
# context; lengths that are and are not multiples of the query block; GQA groups 1, 3, 4.
CASES = [
    (1, 1, 9, 3),
    (1, 37, 9, 3),
    (5, 5, 9, 3),
    (128, 128, 9, 3),
    (200, 200, 9, 3),
    (300, 300, 4, 4),
    (257, 257, 8, 2),
    (130, 700, 9, 3),
    (64, 300, 9, 3),
]


@pytest.mark.parametrize("n,ctx,heads,kv_heads", CASES)
def test_blockwise_float32_matches_sdpa(n, ctx, heads, kv_heads):
    q, k, v = inputs(n, ctx, heads, kv_heads, torch.float32)
    out = _blockwise_causal(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert (out - reference(q, k, v)).abs().max().item() < 1e-5


@pytest.mark.parametrize("n,ctx,heads,kv_heads", CASES)
def test_blockwise_bfloat16_within_bf16_rounding_of_sdpa(n, ctx, heads, kv_heads):
    q, k, v = inputs(n, ctx, heads, kv_heads, torch.bfloat16)
    ref = reference(q, k, v)  # exact attention of the same bf16 inputs
    ours = (_blockwise_causal(q, k, v).float() - ref).abs()
    theirs = (attention.sdpa_causal(q, k, v).float() - ref).abs()  # bf16 SDPA
    # Scores are rounded to bf16 (SDPA keeps them in float32): allow a few bf16 ulps of the
    # output (values are O(1)), and on average no more than twice SDPA's own error.
    assert ours.max().item() < 3e-2
    assert ours.mean().item() < 2 * theirs.mean().item() + 1e-4


@pytest.mark.parametrize("block", [1, 7, 16])
def test_blockwise_with_small_blocks_covers_every_block_boundary(monkeypatch, block):
    monkeypatch.setattr(attention, "QUERY_BLOCK", block)
    for n, ctx in [(1, 1), (23, 23), (16, 16), (17, 40), (48, 48)]:
        q, k, v = inputs(n, ctx, 6, 2, torch.float32, d=16, seed=n)
        assert (_blockwise_causal(q, k, v) - reference(q, k, v)).abs().max().item() < 1e-5


def test_blockwise_writes_into_dest():
    q, k, v = inputs(20, 20, 9, 3, torch.float32)
    dest = torch.full((30, 9, 64), 7.0)
    assert _blockwise_causal(q, k, v, dest=dest[5:25]).data_ptr() == dest[5:25].data_ptr()
    assert (dest[5:25] - reference(q, k, v)).abs().max().item() < 1e-5
    assert (dest[:5] == 7).all() and (dest[25:] == 7).all()


def test_dispatch_uses_blockwise_only_for_long_bf16_spans_on_cpu():
    long_bf16 = torch.zeros(attention.BLOCKWISE_MIN_QUERIES, 9, 64, dtype=torch.bfloat16)
    assert attention._use_blockwise(long_bf16)
    assert not attention._use_blockwise(long_bf16[:-1])
    assert not attention._use_blockwise(long_bf16.float())


def test_engine_with_blockwise_everywhere_matches_sdpa(monkeypatch):
    """Whole, batched, chunked and prefix-hit prefills through the blockwise kernel (forced on
    for every span, in float32) give the SDPA path's greedy tokens."""
    from factories import make_engine, make_model_files, run_to_completion

    from pdserve.engine.sampling_params import SamplingParams

    files = make_model_files(seed=3)
    prompts = [[(7 * i) % 250 + 1 for i in range(150)], [5, 17, 33, 2, 9], list(range(1, 40))]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    no_cache = dict(enable_prefix_caching=False, kv_cache_gb=0.01)
    reference = [run_to_completion(make_engine(files, **no_cache), [p], params)[0] for p in prompts]
    monkeypatch.setattr(attention, "_use_blockwise", lambda q: True)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
    assert run_to_completion(make_engine(files, **no_cache), prompts, params) == reference
    chunked = make_engine(files, chunk_size=24, **no_cache)
    assert run_to_completion(chunked, prompts, params) == reference
    cached = make_engine(files, kv_cache_gb=0.01)
    run_to_completion(cached, prompts[:1], params)
    hits = cached.block_manager.hits
    assert run_to_completion(cached, prompts, params) == reference
    assert cached.block_manager.hits > hits
