"""The blockwise causal prefill kernel against torch's SDPA, for fresh prompts and for the last
queries of a longer context (chunked prefill, prefix-cache hits)."""

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import attention, kernel_rows
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


def test_dispatch_uses_blockwise_only_for_bf16_spans_in_its_range_on_cpu():
    n = attention.BLOCKWISE_MIN_QUERIES
    long_bf16 = torch.zeros(2 * n, 9, 64, dtype=torch.bfloat16)
    assert attention._use_blockwise(long_bf16[:n], (n, 2 * n))
    assert attention._use_blockwise(long_bf16, (n, 2 * n))
    assert not attention._use_blockwise(long_bf16[: n - 1], (n, 2 * n))
    assert not attention._use_blockwise(long_bf16, (n, 2 * n - 1))  # SDPA's above the range
    assert not attention._use_blockwise(long_bf16.float(), attention.KERNEL_QUERIES)
    assert not attention._use_blockwise(long_bf16, (kernel_rows.ALL_ROWS,) * 2)  # SDPA won here


def test_each_layer_gets_the_prompt_attention_measured_on_this_machine(tmp_path, monkeypatch):
    """A bf16 engine on CPU measures, for its heads, from how many queries its own prompt
    kernel beats SDPA here, saves it with the kernels' rows and gives it to every layer; the
    next engine reads it back instead of measuring."""
    from factories import make_engine, make_model_files

    from pdserve import envs

    built = envs.cache_dir() / "ext"  # the built extension, not rebuilt in tmp_path
    built.mkdir(parents=True, exist_ok=True)
    (tmp_path / "ext").symlink_to(built)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    files = make_model_files(seed=3)
    runner = make_engine(files, dtype="bfloat16").runner
    name = f"attention:{runner.model.n_heads}x{runner.model.n_kv}x{runner.kv_shape.dim}"
    measured = kernel_rows.KernelRows(torch.bfloat16).table[name]  # read from the saved file
    first, last = measured
    assert first in (*kernel_rows.ATTENTION_LADDER, kernel_rows.ALL_ROWS) and first <= last
    assert last in (*kernel_rows.ATTENTION_LADDER, kernel_rows.ALL_ROWS)
    assert {layer.attn.kernel_queries for layer in runner.model.layers} == {tuple(measured)}
    monkeypatch.setattr(kernel_rows, "measure_prompt_attention", lambda *a: pytest.fail("again"))
    again = make_engine(files, dtype="bfloat16").runner
    assert {layer.attn.kernel_queries for layer in again.model.layers} == {tuple(measured)}


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
    monkeypatch.setattr(attention, "_use_blockwise", lambda q, first: True)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
    assert run_to_completion(make_engine(files, **no_cache), prompts, params) == reference
    chunked = make_engine(files, chunk_size=24, **no_cache)
    assert run_to_completion(chunked, prompts, params) == reference
    cached = make_engine(files, kv_cache_gb=0.01)
    run_to_completion(cached, prompts[:1], params)
    hits = cached.block_manager.hits
    assert run_to_completion(cached, prompts, params) == reference
    assert cached.block_manager.hits > hits


def _kernel_or_skip():
    q = torch.zeros(1, 9, 64, dtype=torch.bfloat16)
    from pdserve.model.extension import extension_or_none

    if extension_or_none() is None or attention._prompt_kernel(q) is None:
        pytest.skip("no AVX512-BF16 prompt attention in this build (csrc/prefill_attention.h)")
    return attention._prompt_kernel(q)


# (queries, context, heads, kv heads, head_dim): fresh prompts and chunks at a context's end,
# GQA groups 1, 3, 8, lengths on and off the 16-key tiles and the 16-position items
PROMPT_CASES = [
    (1, 1, 9, 3, 64), (37, 37, 9, 3, 64), (256, 256, 9, 3, 64), (257, 257, 8, 8, 128),
    (130, 130, 16, 2, 32), (100, 356, 9, 3, 64), (1, 300, 9, 3, 64), (64, 1100, 4, 4, 64),
]  # fmt: skip


@pytest.mark.parametrize("n,ctx,heads,kv_heads,d", PROMPT_CASES)
def test_the_prompt_kernel_rounds_as_blockwise_does(n, ctx, heads, kv_heads, d):
    """Its scores, probabilities and outputs are rounded to bf16 where eager's are; only the
    float sums' order differs, which moves an output by one bf16 step now and then."""
    ext = _kernel_or_skip()
    q, k, v = inputs(n, ctx, heads, kv_heads, torch.bfloat16, d=d, seed=n + ctx)
    ours, eager = ext.prefill_attention(q, k, v).float(), _blockwise_causal(q, k, v).float()
    diff = (ours - eager).abs()
    assert diff.max().item() <= 2 * 2**-8 * max(eager.abs().max().item(), 1.0)
    assert (diff > 0).float().mean().item() < 0.01
    ref = reference(q, k, v)  # and as far from exact attention as eager is
    assert (ours - ref).abs().mean().item() < 1.05 * (eager - ref).abs().mean().item() + 1e-5


def test_the_prompt_kernel_reads_heads_out_of_the_projection_rows():
    """q, k and v as the model passes them: views into one (n, (H + 2 KV) d) row each."""
    ext = _kernel_or_skip()
    n, heads, kv, d = 50, 9, 3, 64
    qkv = torch.randn(n, (heads + 2 * kv) * d).to(torch.bfloat16)
    q = qkv[:, : heads * d].view(n, heads, d)
    k = qkv[:, heads * d : (heads + kv) * d].view(n, kv, d)
    v = qkv[:, (heads + kv) * d :].view(n, kv, d)
    whole = ext.prefill_attention(q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(ext.prefill_attention(q, k, v), whole)
    with pytest.raises(RuntimeError, match="bf16 q, k, v"):
        ext.prefill_attention(q.float(), k.float(), v.float())


def test_a_bf16_engine_attends_prompts_with_the_kernel_as_eager_does(monkeypatch):
    """Whole and chunked prefills (a later chunk reads the cached K/V, as a prefix hit does) of
    a bf16 engine go through the kernel where the blockwise path ran (128 queries and more), and
    every position's logits stay within bf16 noise of the blockwise path's."""
    from factories import make_engine, make_model_files

    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.scheduler import ScheduledBatch
    from pdserve.engine.sequence import Sequence

    _kernel_or_skip()
    files = make_model_files(seed=5, num_heads=6, num_kv_heads=2, hidden_size=384)
    engine = make_engine(files, dtype="bfloat16", weights="bf16")
    runner = engine.runner
    for layer in runner.model.layers:  # the kernel from 128 queries, whatever won here
        layer.attn.kernel_queries = attention.KERNEL_QUERIES
    ids = [(7 * i) % 250 + 1 for i in range(300)]

    def logits(chunks):
        seq = Sequence("s", ids, SamplingParams(max_tokens=1))
        assert engine.block_manager.allocate(seq)
        out = []
        try:
            with torch.inference_mode():
                for start, end in chunks:
                    seq.num_computed_tokens = start
                    inp, pos, meta, *_ = runner._prepare(ScheduledBatch([seq], [end - start]))
                    out.append(runner.model.logits(runner.model(inp, pos, runner.kv_caches, meta)))
        finally:
            engine.block_manager.free(seq)
        return torch.cat(out).float()

    calls = []
    real = attention._prompt_kernel
    monkeypatch.setattr(attention, "_prompt_kernel", lambda q: calls.append(1) or real(q))
    whole, chunked = logits([(0, 300)]), logits([(0, 140), (140, 300)])
    assert len(calls) == 3 * files.config.num_layers
    calls.clear()
    logits([(0, 100)])  # below BLOCKWISE_MIN_QUERIES: SDPA, whose scores stay in float32
    assert not calls
    monkeypatch.setattr(attention, "_prompt_kernel", lambda q: None)
    eager = logits([(0, 300)])
    for ours in (whole, chunked):
        assert (ours - eager).abs().mean().item() < 0.02
        assert (ours.argmax(-1) == eager.argmax(-1)).float().mean().item() > 0.97
