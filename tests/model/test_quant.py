"""Weight formats (model/quant.py): GGUF 4-bit blocks packed without loss, the int4/int8 kernels
against the dense product, the batch-size switch, and errors that say what to do."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from factories import make_engine, run_to_completion

from pdserve.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model import quant
from pdserve.model.quant import Int4Blocks, Int4Linear, Int8Linear


def dequantize(b: Int4Blocks) -> np.ndarray:
    return (b.q.astype(np.float32) - 8) * np.repeat(b.scale, 32, 1) + np.repeat(b.zero, 32, 1)


def test_int4_kernel_computes_the_blocks_weights_exactly_and_switches_to_dense_above_16_rows():
    rng = np.random.default_rng(0)
    n, k = 48, 96
    blocks = Int4Blocks(
        rng.integers(0, 16, (n, k)).astype(np.uint8),
        rng.uniform(0.01, 0.1, (n, k // 32)).astype(np.float32),
        rng.normal(0, 0.1, (n, k // 32)).astype(np.float32),
    )
    w = torch.from_numpy(dequantize(blocks))
    lin = Int4Linear(w, blocks)
    for rows in (1, 5, quant.MAX_ROWS["int4"]):
        x = torch.randn(rows, k)
        assert torch.allclose(lin(x), F.linear(x, w), atol=1e-4, rtol=1e-4)
    x = torch.randn(quant.MAX_ROWS["int4"] + 1, k)
    assert torch.equal(lin(x), F.linear(x, w))  # above MAX_ROWS: the dense weight itself


def int8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """csrc/few_rows.h's rows: each group of 32 as int8 (round half to even) and its scale."""
    g = x.float().reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(g * inv[..., None]), amax / 127


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_few_row_kernels_compute_int8_rows_exactly_and_give_each_row_the_same_bits(fmt):
    """csrc/few_rows.h (bf16, N a multiple of 16) for 1 to 20 rows (its passes of 8 rows and
    the remainder): the rows as int8 groups of 32 times the quantized weight, as float64
    computes it; within a few % of torch's own int4/int8 kernel (bf16 rows); and each row bit
    for bit what it is alone: a step verifying 1 + k speculated tokens gives its first row
    exactly the logits of a plain step."""
    torch.manual_seed(0)
    w = torch.randn(96, 128, dtype=torch.bfloat16) * 0.05
    lin = Int4Linear(w) if fmt == "int4" else Int8Linear(w)
    assert lin.kind == {"int4": 3, "int8": 4}[fmt]  # the extension is built by make install
    if fmt == "int4":
        b = quant.int4_blocks(w)
        q = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(b.q).to(torch.int32), 1)
        sz = np.stack([b.scale, b.zero], -1).transpose(1, 0, 2)
        sz = torch.from_numpy(np.ascontiguousarray(sz)).to(torch.bfloat16)
        reference = lambda x: torch._weight_int4pack_mm_for_cpu(x, q, 32, sz)  # noqa: E731
        # the packed (bf16) scales and zeros, as the kernel reads them
        scale = torch.from_numpy(b.scale).bfloat16().double()
        zero = torch.from_numpy(b.zero).bfloat16().double()
        wq = torch.from_numpy(b.q).double().reshape(96, 4, 32)

        def exact(x):
            xq, d = int8_groups(x)
            isum = torch.einsum("mgk,ngk->mng", xq.double(), wq)
            return (isum * scale[None] * d.double()[:, None]).sum(-1) + (
                (zero - 8 * scale)[None] * (d.double() * xq.double().sum(-1))[:, None]
            ).sum(-1)
    else:
        reference = lambda x: torch._weight_int8pack_mm(x, lin.q, lin.scales)  # noqa: E731

        def exact(x):
            xq, d = int8_groups(x)
            isum = torch.einsum("mgk,ngk->mng", xq.double(), lin.q.double().reshape(96, 4, 32))
            return (isum * d.double()[:, None]).sum(-1) * lin.scales.double()

    for rows in (1, 2, 5, 8, 9, 20):
        x = torch.randn(rows, 128, dtype=torch.bfloat16)
        got = lin.quantized_mm(x).double()
        assert (got - exact(x)).abs().max() <= 0.005 * got.abs().max()  # bf16's rounding
        want = reference(x).double()
        assert (got - want).abs().max() <= 0.03 * want.abs().max()
        for r in (0, rows - 1):
            assert torch.equal(lin.quantized_mm(x[r : r + 1])[0], lin.quantized_mm(x)[r])


def test_prompt_rows_run_the_dense_weight_and_decode_rows_the_few_row_kernels(files):
    """A step computing prompt tokens keeps bf16 rows (their K/V is read by every later
    token): its quantized linears leave their few-row kernels (int8 rows) to the dense
    weight. A chunk past the prompt (a verify step's rows on the eager path) and decode rows
    keep them; benchmarks/quality.py's FEW_ROWS_FOR_PROMPTS scores them on prompts."""
    from pdserve.engine.scheduler import ScheduledBatch
    from pdserve.engine.sequence import Sequence

    torch.manual_seed(0)
    lin = Int4Linear(torch.randn(96, 128, dtype=torch.bfloat16) * 0.05)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    assert lin.kind == 3 and not torch.equal(lin.quantized_mm(x), F.linear(x, lin.weight))
    with quant.prompt_rows(True):
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    assert torch.equal(lin(x), lin.quantized_mm(x))
    quant.FEW_ROWS_FOR_PROMPTS = True
    try:
        with quant.prompt_rows(True):
            assert torch.equal(lin(x), lin.quantized_mm(x))
    finally:
        quant.FEW_ROWS_FOR_PROMPTS = False
    eng = make_engine(files)
    seq = Sequence("r", list(range(1, 17)), SamplingParams(max_tokens=4), num_prompt_tokens=10)
    assert eng.block_manager.allocate(seq)
    try:
        for start, n, prompt in ((0, 6, True), (4, 6, True), (10, 3, False)):
            seq.num_computed_tokens = start
            meta = eng.runner._prepare(ScheduledBatch([seq], [n]))[2]
            assert [span.prompt for span in meta.prefills] == [prompt]
    finally:
        eng.block_manager.free(seq)


def _onednn_or_skip():
    if not quant.onednn_packs(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("no oneDNN bf16 GEMM on this CPU (AVX512-BF16 or AMX)")


def _within_bf16_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Both sum in float32 and round once to bf16: at most a step of bf16 apart (the same bits
    on the Zen 4 where it was written; another oneDNN may order the sums otherwise)."""
    return torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-3)


def test_bf16_dense_weights_run_from_onednn_layout():
    """Where oneDNN has a bf16 GEMM, a dense bf16 weight is held in its layout (F.linear
    reorders the plain weight on every call): its product at every row count and input shape
    (3-D, strided) within bf16 rounding of F.linear's, the plain weight still readable, the
    fused step handed the packed one; float32 weights stay with F.linear."""
    _onednn_or_skip()
    torch.manual_seed(0)
    w = torch.randn(96, 128, dtype=torch.bfloat16)
    lin = quant.Dense(w.clone())
    lin.pack()
    assert lin.onednn and lin.shape == (96, 128) and torch.equal(lin.weight, w)
    xs = [torch.randn(n, 128, dtype=torch.bfloat16) for n in (1, 16, 300)]
    xs += [torch.randn(2, 5, 128, dtype=torch.bfloat16), torch.randn(16, 256).bfloat16()[:, 64:192]]
    for x in xs:
        y = lin(x)
        assert y.shape == (*x.shape[:-1], 96) and _within_bf16_rounding(y, F.linear(x, w)), x.shape
    assert lin.kernel_spec()[2][0].is_mkldnn
    f32 = quant.Dense(w.float())
    f32.pack()
    assert not f32.onednn and torch.equal(f32(xs[0].float()), F.linear(xs[0].float(), w.float()))


def test_a_packed_quantized_linears_dense_path_is_its_weights_product():
    """Prompt rows (and rows above the quantized kernel's) run the packed dense copy."""
    _onednn_or_skip()
    torch.manual_seed(0)
    lin = Int4Linear(torch.randn(96, 128, dtype=torch.bfloat16) * 0.05)
    w = lin.weight.clone()
    lin.pack()
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    with quant.prompt_rows(True):
        assert _within_bf16_rounding(lin(x), F.linear(x, w))
    assert torch.equal(lin(x), lin.quantized_mm(x))  # decode rows keep the few-row kernel


@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_a_bf16_engine_holds_its_dense_weights_in_onednn_layout(files, weights, monkeypatch):
    """bf16 weights and their lm_head; an int4 model's dense copies (prompts, big batches),
    but not its int8 lm_head's when that is the tied embeddings (a copy of the whole table for
    a few prompt rows)."""
    _onednn_or_skip()
    monkeypatch.setenv("PDSERVE_QUANT_MAX_ROWS", "16")  # no kernel timing
    model = make_engine(files, dtype="bfloat16", weights=weights).runner.model
    assert all(lin.onednn for lin in model.linears())
    tied = files.config.tie_word_embeddings and weights == "int4"
    assert model.lm_head.onednn is not tied
    assert not any(lin.onednn for lin in make_engine(files).runner.model.linears())  # float32


def amx_extension():
    from pdserve.model.extension import load_extension

    ext = load_extension()
    if not ext.amx_available():
        pytest.skip("this CPU (or build) has no AMX-BF16 tiles")
    return ext


@pytest.mark.parametrize("n,k", [(96, 128), (32, 1536)])
def test_the_int4_amx_kernel_is_the_bf16_weights_product_and_each_row_its_own(n, k):
    """csrc/few_rows.h `mm_amx` (the int4 few-row kind from `amx_from` rows): each weight
    unpacked to bf16 as (q - 8) * scale + zero, times the bf16 rows summed in float32, for 1 to
    130 rows (passes of 64, the last tile padded with zero rows); a row's result the same bits
    whatever rows are beside it, and x read from wherever it lies (not 64-byte aligned: copied)."""
    ext = amx_extension()
    torch.manual_seed(1)
    w = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
    b = quant.int4_blocks(w)
    q, sz = quant.pack_few_rows(b, torch.bfloat16)
    scale = torch.from_numpy(b.scale).bfloat16().float().repeat_interleave(32, 1)
    zero = torch.from_numpy(b.zero).bfloat16().float().repeat_interleave(32, 1)
    wb = ((torch.from_numpy(b.q).float() - 8) * scale + zero).bfloat16().double()
    for rows in (1, 15, 16, 17, 64, 65, 130):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        got = ext.few_rows_mm(x, q, sz, 1)
        want = x.double() @ wb.T
        assert (got.double() - want).abs().max() <= 0.005 * want.abs().max()  # bf16's rounding
        for r in (0, rows - 1):
            assert torch.equal(ext.few_rows_mm(x[r : r + 1], q, sz, 1)[0], got[r])
        shifted = torch.empty(rows * k + 8, dtype=torch.bfloat16)[8:].view(rows, k)
        shifted.copy_(x)  # 16 bytes past an aligned start
        assert torch.equal(ext.few_rows_mm(shifted, q, sz, 1), got)
    vnni = ext.few_rows_mm(x, q, sz)  # by default
    assert torch.equal(vnni, ext.few_rows_mm(x, q, sz, quant.NEVER))
    assert not torch.equal(ext.few_rows_mm(x, q, sz, rows + 1), got)  # below amx_from: VNNI's


def test_the_int8_amx_kernel_is_the_bf16_weights_product_in_bf16_or_float():
    """csrc/few_rows.h `mm8_amx` (the int8 kind from `amx_from` rows: the lm_head of a big
    decode batch): each weight (w + 128 - 128) * its column's scale in bf16, times the bf16
    rows summed in float32; as bf16 (the eager step) or as floats holding the same bf16 values
    (the fused step's logits), each row its own bits."""
    ext = amx_extension()
    torch.manual_seed(2)
    w = torch.randn(96, 576, dtype=torch.bfloat16) * 0.05
    lin = Int8Linear(w)
    wb = (lin.q.float() * lin.scales.float()[:, None]).bfloat16().double()
    for rows in (1, 16, 40, 64, 70):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        got = ext.few_rows_mm8(x, *lin.tensors, 1)
        want = x.double() @ wb.T
        assert (got.double() - want).abs().max() <= 0.005 * want.abs().max()
        assert torch.equal(ext.few_rows_mm8(x[-1:], *lin.tensors, 1)[0], got[-1])
    lin.amx_from = 1
    assert torch.equal(lin.quantized_mm(x), got)


def test_few_row_kernels_leave_what_they_cannot_run_to_torch():
    """float32 weights, or N not a multiple of 16 (int8; torch's int4 packing needs it too):
    torch's kernels, as before."""
    w = torch.randn(48, 64)
    assert (Int4Linear(w).kind, Int8Linear(w).kind) == (1, 2)
    assert Int4Linear(w).quantized_mm(torch.randn(3, 64)).shape == (3, 48)
    w = torch.randn(40, 64, dtype=torch.bfloat16)
    assert Int8Linear(w).kind == 2
    assert Int8Linear(w).quantized_mm(torch.randn(3, 64, dtype=torch.bfloat16)).shape == (3, 40)


def test_an_int8_weight_gets_the_same_bits_from_the_extension_as_from_torch(ext):
    """Int8Linear's rows quantized by the extension's one pass (every bf16 worker's int8
    lm_head at its start) are torch's bits: scales and values, a zero row's and ties' too."""
    w = (torch.randn(256, 576) * 0.05).to(torch.bfloat16)
    w[3] = 0  # a zero row: scale 1e-12, values 0
    w[5, :4] = torch.tensor([1.0, 0.5, -0.25, 0.125])  # exact halves after scaling: ties
    w[5, 4:] = 0
    q, scale = quant.int8_rows(w, ext)
    q_ref, scale_ref = quant.int8_rows(w)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    assert scale[3].item() == pytest.approx(1e-12) and not q[3].any()
    lin = Int8Linear(w)
    assert lin.kind == 4 and torch.equal(lin.q, q_ref)


def test_min_max_int4_and_int8_stay_within_half_a_step_of_the_weight():
    w = torch.randn(64, 128)
    b = quant.int4_blocks(w)
    assert b.q.max() <= 15 and b.q.min() >= 0
    err = np.abs(dequantize(b) - w.numpy())
    assert (err <= np.repeat(b.scale, 32, 1) / 2 + 1e-6).all()
    lin = Int8Linear(w)
    err8 = (lin.q.float() * lin.scales[:, None] - w).abs()
    assert (err8 <= lin.scales[:, None] / 2 + 1e-6).all()
    x = torch.randn(3, 128)
    assert torch.allclose(lin(x), x @ (lin.q.float() * lin.scales[:, None]).T, atol=1e-4)


def test_auto_picks_int4_for_4_bit_files_int8_otherwise_and_dense_on_gpus_and_in_float32():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    some = {"w": Int4Blocks(np.zeros((1, 32), np.uint8), np.ones((1, 1)), np.zeros((1, 1)))}
    assert quant.resolve_format("auto", cpu, some) == "int4"
    assert quant.resolve_format("auto", cpu, {}) == "int8"
    assert quant.resolve_format("auto", gpu, some) == "bf16"
    assert quant.resolve_format("int8", cpu, some) == "int8"
    assert quant.resolve_format("auto", cpu, some, torch.float32) == "bf16"  # no fast kernel


def test_formats_that_cannot_run_say_what_to_use():
    with pytest.raises(ValueError, match="CPU only.*--weights bf16"):
        quant.check_format("int4", torch.device("cuda"), 64)
    with pytest.raises(ValueError, match="divisible by 32.*int8 or bf16"):
        quant.check_format("int4", torch.device("cpu"), 48)
    with pytest.raises(ValueError, match="weights must be auto, bf16, int8 or int4"):
        EngineConfig(weights="fp4")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_engine_serves_every_variant_with_its_blocks_returned(files, fmt):
    eng = make_engine(files, weights=fmt)
    assert eng.runner.weights == fmt
    assert {type(eng.runner.model.layers[0].attn.qkv).format, eng.runner.model.lm_head.format} == {
        fmt,
        "int8",
    }
    prompts = [[5, 17, 33, 2, 9], list(range(1, 30))]
    out = run_to_completion(eng, prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o) for o in out] == [8, 8]
    eng.check_integrity()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.slow
def test_bundled_q4_1_blocks_are_read_as_stored_and_int4_greedy_matches_bf16():
    """The bundled GGUF's linears are Q4_1: their blocks dequantize to exactly the float
    weights the loader makes, and int4 decodes the same greedy tokens as bf16 (float32
    activations, where the two differ only by rounding)."""
    from pdserve import LLM
    from pdserve.model.loader import load_int4_blocks, load_model_files

    files = load_model_files(None)
    blocks = load_int4_blocks(files)
    assert len(blocks) == 7 * files.config.num_layers
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight"):
        assert np.array_equal(dequantize(blocks[name]), files.weights[name])
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    out = {
        fmt: [o.token_ids for o in LLM(dtype="float32", weights=fmt).generate(prompts, params)]
        for fmt in ("bf16", "int4")
    }
    assert out["int4"] == out["bf16"]
