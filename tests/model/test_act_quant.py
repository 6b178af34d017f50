"""Int8 activations (model/act_quant.py): the W8A8 product against the dense one, smoothing
against outlier channels, rows computed independently of their batch, the measured range of
rows it runs, and an engine that calibrates at load and gives the same tokens fused and eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from factories import make_engine, make_model_files, run_to_completion, spin

from pdserve.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model import act_quant, kernel_rows, quant

pytestmark = pytest.mark.skipif(not act_quant.supported(), reason="no int8 GEMM in this torch")


def _outlier_inputs(rows: int, k: int) -> torch.Tensor:
    x = torch.randn(rows, k)
    x[:, 3] *= 60  # LLM activations: a few channels far larger than the rest
    x[:, 17] *= 25
    return x


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


def test_smoothed_int8_activations_track_the_dense_product_where_per_token_alone_does_not():
    torch.manual_seed(0)
    w, x = torch.randn(96, 128) / 10, _outlier_inputs(40, 128)
    ref = F.linear(x, w)
    smoothed = act_quant.Int8Activations(w, x.abs().amax(0))
    unsmoothed = act_quant.Int8Activations(w, None)  # per-token scales only
    err, err_plain = _relative_error(smoothed(x), ref), _relative_error(unsmoothed(x), ref)
    assert err < 0.02
    assert err < err_plain / 2


def test_each_row_is_computed_alone_so_a_batch_does_not_change_a_sequence_s_numbers():
    torch.manual_seed(1)
    w, x = torch.randn(64, 96) / 10, _outlier_inputs(24, 96).to(torch.bfloat16)
    a8 = act_quant.Int8Activations(w.to(torch.bfloat16), x.float().abs().amax(0))
    whole = a8(x)
    assert whole.dtype == torch.bfloat16
    for i in (0, 7, 23):
        assert torch.equal(whole[i : i + 1], a8(x[i : i + 1]))


def test_int8_activations_get_the_longest_run_of_row_counts_where_they_beat_the_dense_gemm():
    # dense: 300 us + 10 us per row; int8: 600 us + 2 us per row -> wins above 37.5 rows
    def dense(x):
        spin(300 + 10 * x.shape[0])

    def a8(x):
        spin(600 + 2 * x.shape[0])

    first, last = kernel_rows.measure_a8(dense, a8, 8, 8, torch.float32)
    assert (first, last) == (33, kernel_rows.ALL_ROWS)  # above 32, the last count lost
    slower = lambda x: spin(400 + 20 * x.shape[0])  # noqa: E731
    assert kernel_rows.measure_a8(dense, slower, 8, 8, torch.float32) == (0, 0)


def test_int8_activations_never_take_rows_from_the_quantized_kernel():
    # int8 faster than everything from 1 row, timed alone: the quantized kernel keeps its 16
    # rows all the same (a model streams its weights, where int4's bytes win)
    first, _ = kernel_rows.measure_a8(
        lambda x: spin(2000), lambda x: spin(150), 16, 8, torch.float32
    )
    assert first == 17


def test_the_measured_range_is_saved_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PDSERVE_QUANT_MAX_ROWS", raising=False)
    monkeypatch.delenv("PDSERVE_INT8_ACT_ROWS", raising=False)
    monkeypatch.setattr(kernel_rows, "measure", lambda *a: 4)
    monkeypatch.setattr(kernel_rows, "measure_a8", lambda *a: (5, 512))
    lin = quant.Int4Linear((torch.randn(64, 96) / 10).to(torch.bfloat16))
    rows = kernel_rows.KernelRows(torch.bfloat16, threads=2)
    assert rows.a8_rows("int4", lin) == (5, 512)
    rows.save()
    monkeypatch.setattr(kernel_rows, "measure_a8", lambda *a: pytest.fail("measured again"))
    again = kernel_rows.KernelRows(torch.bfloat16, threads=2)
    assert again.a8_rows("int4", lin) == (5, 512) and not again.measured


@pytest.fixture(scope="module")
def tiny_files():
    return make_model_files(seed=3)


def _int4_engine(files, monkeypatch, mode: str, **kw):
    monkeypatch.setenv("PDSERVE_QUANT_MAX_ROWS", "2")
    monkeypatch.setenv("PDSERVE_INT8_ACT_ROWS", "100000")
    return make_engine(files, weights="int4", int8_activations=mode, **kw)


def test_an_engine_calibrates_at_load_and_its_prefill_tracks_the_dense_copy(
    tiny_files, monkeypatch
):
    a8 = _int4_engine(tiny_files, monkeypatch, "on")
    dense = _int4_engine(tiny_files, monkeypatch, "off")
    assert a8.runner.activations.startswith("int8") and dense.runner.activations == "dense"
    model = a8.runner.model
    assert all(lin.a8 is not None for lin in model.linears())
    assert model.lm_head.a8 is None  # int8 rows there cost +1 % perplexity, for few rows a step
    qkv = model.layers[0].attn.qkv
    assert qkv.a8 is not None and tuple(qkv.a8_rows) == (3, 100000)
    x = torch.randn(40, qkv.weight.shape[1]).to(qkv.weight.dtype)
    assert _relative_error(qkv(x).float(), F.linear(x, qkv.weight).float()) < 0.03
    prompts = [list(range(5, 45)), list(range(60, 100))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert [len(o) for o in run_to_completion(a8, prompts, params)] == [6, 6]
    a8.check_integrity()


def test_the_fused_step_runs_int8_activations_as_the_eager_model_does(tiny_files, monkeypatch):
    prompts = [[3 + i, 40 + i, 7, 19 + i] for i in range(6)]  # 6 decode rows > 2: int8 rows
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fused = _int4_engine(tiny_files, monkeypatch, "on", dtype="bfloat16")
    eager = _int4_engine(tiny_files, monkeypatch, "on", dtype="bfloat16", enforce_eager=True)
    if fused.runner.fused is None:
        pytest.skip(f"no fused step here: {fused.runner.decode_path}")
    assert run_to_completion(fused, prompts, params) == run_to_completion(eager, prompts, params)


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="int8_activations must be off or on"):
        EngineConfig(int8_activations="int4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_kernels_give_the_torch_reference_s_bits(dtype):
    ext = act_quant._kernels()
    if ext is None:
        pytest.skip("the fused step's extension does not build here")
    torch.manual_seed(2)
    w, x = torch.randn(80, 96) / 10, _outlier_inputs(37, 96).to(dtype)
    a8 = act_quant.Int8Activations(w.to(dtype), x.float().abs().amax(0))
    ref = act_quant.reference(x, a8.q, a8.scales, a8.inv_smooth)
    assert torch.equal(a8(x), ref)
