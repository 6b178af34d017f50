"""The 8-bit KV cache (`--kv-cache-dtype int8`, model/kv_int8.py): rows of int8 values with
their scale inline, written and read by eager attention (the fused step's own is compared with
eager in test_fused_decode.py), sized by the engine at about half a bf16 block's bytes, and
refused where it does not apply."""

import pytest
import torch
from factories import make_engine, run_to_completion

from pdserve.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model import kv_int8
from pdserve.model.attention import AttentionMetadata, DecodeGroup, paged_attention


def test_a_row_is_its_values_then_its_float32_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g).bfloat16()
    x[2, 1] = 0  # a row of zeros: scale 1, values 0
    rows = kv_int8.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (7, 3, kv_int8.row_width(64))
    scale = rows[..., 64:].contiguous().view(torch.float32)[..., 0]
    amax = x.float().abs().amax(-1)
    assert torch.allclose(scale[amax > 0], amax[amax > 0] / 127)
    assert scale[2, 1] == 1 and (rows[2, 1, :64] == 0).all()
    assert rows[..., :64].abs().max() == 127  # each row's largest value takes the full range
    back = kv_int8.dequantize(rows, torch.float32)
    assert ((back - x.float()).abs() <= scale[..., None] / 2 + 1e-6).all()  # half a step


def test_paged_attention_writes_quantized_rows_and_reads_them_back():
    """One decode query over 40 cached tokens: the int8 cache gives the bf16 cache's output
    within the quantization's error, and its rows are `quantize` of what was written."""
    g = torch.Generator().manual_seed(1)
    n_kv, d, bs, ctx = 3, 64, 16, 40
    k, v = (torch.randn(ctx, n_kv, d, generator=g) for _ in range(2))
    q = torch.randn(1, 9, d, generator=g)
    table = torch.tensor([[2, 0, 3]])
    slots = torch.cat([table[0, t // bs : t // bs + 1] * bs + t % bs for t in range(ctx)])
    mask = (torch.arange(3 * bs) < ctx)[None, None, None, :]
    outs = {}
    for dtype, width in ((torch.float32, d), (torch.int8, kv_int8.row_width(d))):
        kc, vc = (torch.zeros(4, bs, n_kv, width, dtype=dtype) for _ in range(2))
        write = AttentionMetadata(slots, 0, [], [])
        paged_attention(k, k, v, kc, vc, write)  # the prompt's K/V into the cache
        meta = AttentionMetadata(slots[-1:], 1, [DecodeGroup(0, 1, table, mask)], [])
        outs[dtype] = paged_attention(q, k[-1:], v[-1:], kc, vc, meta)
        if dtype == torch.int8:
            assert torch.equal(kc.view(-1, n_kv, width)[slots], kv_int8.quantize(k))
    err = (outs[torch.int8] - outs[torch.float32]).abs().max().item()
    assert 0 < err < 0.05


def test_an_int8_cache_holds_about_twice_the_tokens_in_the_same_memory(files):
    auto = make_engine(files, dtype="bfloat16", kv_cache_gb=0.01)
    int8 = make_engine(files, dtype="bfloat16", kv_cache_gb=0.01, kv_cache_dtype="int8")
    d = files.config.head_dim
    assert int8.runner.k_caches[0].dtype == torch.int8
    assert int8.runner.k_caches[0].shape[-1] == kv_int8.row_width(d)
    assert int8.runner.num_blocks / auto.runner.num_blocks == pytest.approx(
        2 * d / (d + 4), rel=0.01
    )


def test_an_int8_engine_generates_through_chunked_prefill_and_prefix_hits(files):
    """Prompt chunks over a cached (quantized) prefix, decode steps fused and eager: each
    path's tokens are the model's (finite logits, a full answer), and a second request for the
    same prompt hits the cache and is answered as the first (both read the same rows)."""
    prompt = [(t * 11) % 250 + 1 for t in range(50)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for eager in (False, True):
        eng = make_engine(files, dtype="bfloat16", kv_cache_dtype="int8", chunk_size=16,
                          enforce_eager=eager)  # fmt: skip
        first = run_to_completion(eng, [prompt + [7]], params)[0]
        again = run_to_completion(eng, [prompt + [7]], params)[0]
        assert len(first) == 12 and again == first
        assert eng.block_manager.hits >= 48  # the second prompt's whole blocks


def test_the_flag_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or int8"):
        EngineConfig(kv_cache_dtype="fp8")


def test_int8_cache_and_fp8_wire_compression_are_refused_together():
    from pdserve.serving.worker_config import check_kv_compression

    check_kv_compression("none", "tcp", "int8")
    with pytest.raises(ValueError, match="drop --kv-compression"):
        check_kv_compression("fp8", "tcp", "int8")


def test_a_decode_step_over_an_int8_cache_keeps_the_logits_close(files):
    """Eager decode steps of three sequences over their prompts' cached K/V: the logits over
    the 8-bit cache stay within the quantization's small error of those over a float32 cache,
    with the same greedy tokens."""
    from model.test_fused_decode import PROMPTS, decode_batch

    logits = []
    for kv in ("auto", "int8"):
        eng = make_engine(files, kv_cache_dtype=kv, enforce_eager=True)
        rows, out = eng.runner.run(decode_batch(eng, PROMPTS))
        logits.append(out[torch.tensor(rows).argsort()])
    err = (logits[0] - logits[1]).abs().max().item()
    assert 0 < err < 0.1
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cache_dtype", ["same", "int8"])
def test_the_extensions_write_gives_torchs_bytes(dtype, cache_dtype):
    """csrc/decode.cpp `write_kv` (a prefill's rows, both threads) writes what index_copy_ of
    the rows, or of `kv_int8.quantize`'s, writes: the same bytes, row by row at its slot."""
    from pdserve.model.extension import load_extension

    ext = load_extension()
    g = torch.Generator().manual_seed(3)
    n, n_kv, d = 100, 3, 64
    x = (torch.randn(n, n_kv, d, generator=g) * 3).to(dtype)
    x[5, 1] = 0
    slots = torch.randperm(8 * 16, generator=g)[:n]
    width = kv_int8.row_width(d) if cache_dtype == "int8" else d
    kind = torch.int8 if cache_dtype == "int8" else dtype
    ours, torchs = (torch.zeros(8, 16, n_kv, width, dtype=kind) for _ in range(2))
    ext.write_kv(x, ours, slots)
    rows = kv_int8.quantize(x) if cache_dtype == "int8" else x
    torchs.view(-1, n_kv, width).index_copy_(0, slots, rows)
    assert torch.equal(ours, torchs)
