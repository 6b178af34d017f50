"""This machine's kernel table (model/kernel_rows.py): the crossover found from timings, kept
per machine key, read back without measuring, invalidated when the key changes, and applied to
each quantized linear of a model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from factories import make_model_config, make_model_files, spin

from pdserve.model import kernel_rows, quant
from pdserve.model.kernel_rows import KernelRows, measure
from pdserve.model.llama import LlamaModel


def test_the_crossover_is_the_last_row_count_where_the_quantized_kernel_wins():
    # quantized: 100 us per row; dense: 1,000 us whatever the rows -> wins up to 9 rows
    def quantized(x):
        spin(100 * x.shape[0])

    def dense(x):
        spin(1000)

    assert measure(dense, quantized, 8, torch.float32) == 8  # the ladder's last count below 10


def test_a_quantized_kernel_that_never_wins_gets_zero_rows():
    assert measure(lambda x: None, lambda x: spin(200), 8, torch.float32) == 0


def test_the_amx_kernel_runs_from_the_fewest_rows_where_it_wins_at_every_larger_count():
    # AMX: 2,000 us whatever the rows; the few-row kernel 100 us a row -> AMX from 24 rows
    def few_rows(x):
        spin(100 * x.shape[0])

    def amx(x):
        spin(2000)

    assert kernel_rows.measure_amx(few_rows, amx, 8, torch.float32) == 24
    assert kernel_rows.measure_amx(amx, few_rows, 8, torch.float32) == quant.NEVER


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from pdserve import envs

    built = envs.cache_dir() / "ext"  # the built extension, not rebuilt in tmp_path
    built.mkdir(parents=True, exist_ok=True)
    (tmp_path / "ext").symlink_to(built)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PDSERVE_QUANT_MAX_ROWS", raising=False)
    return tmp_path


def _linear():
    return quant.Int4Linear((torch.randn(64, 96) / 10).to(torch.bfloat16))


def test_a_measured_table_is_saved_and_read_back_without_measuring(cache, monkeypatch):
    monkeypatch.setattr(kernel_rows, "measure", lambda *a: 12)
    rows = KernelRows(torch.bfloat16, threads=2)
    assert rows.max_rows("int4", _linear()) == 12
    rows.save()
    assert rows.path.parent == cache / "kernels" and rows.path.exists()

    def fail(*a):
        raise AssertionError("measured again")

    monkeypatch.setattr(kernel_rows, "measure", fail)
    again = KernelRows(torch.bfloat16, threads=2)
    assert again.max_rows("int4", _linear()) == 12 and not again.measured


def test_the_table_is_per_cpu_torch_dtype_and_thread_count(cache, monkeypatch):
    paths = {
        kernel_rows.table_path(torch.bfloat16, 2),
        kernel_rows.table_path(torch.bfloat16, 1),
        kernel_rows.table_path(torch.float16, 2),
    }
    monkeypatch.setattr(kernel_rows, "cpu_flags", lambda: "flags : avx2 (another CPU)")
    paths.add(kernel_rows.table_path(torch.bfloat16, 2))
    monkeypatch.setattr(kernel_rows, "VERSION", kernel_rows.VERSION + 1)
    paths.add(kernel_rows.table_path(torch.bfloat16, 2))
    assert len(paths) == 5


def test_the_environment_fixes_the_rows_for_every_shape(cache, monkeypatch):
    monkeypatch.setenv("PDSERVE_QUANT_MAX_ROWS", "3")
    monkeypatch.setattr(kernel_rows, "measure", lambda *a: pytest.fail("measured"))
    assert KernelRows(torch.bfloat16).max_rows("int4", _linear()) == 3
    monkeypatch.setenv("PDSERVE_QUANT_MAX_ROWS", "many")
    with pytest.raises(ValueError, match="PDSERVE_QUANT_MAX_ROWS must be a whole number"):
        KernelRows(torch.bfloat16)


def test_each_quantized_linear_of_a_model_gets_its_shapes_rows(cache, monkeypatch):
    files = make_model_files(seed=1)
    model = LlamaModel(make_model_config(), files.weights, torch.bfloat16, torch.device("cpu"))
    rows = {("int4", 128, 64): 4, ("int4", 64, 64): 8, ("int4", 256, 64): 12,
            ("int4", 64, 128): 16, ("int8", 256, 64): 2}  # fmt: skip

    ran: list = []
    for cls in (quant.Int4Linear, quant.Int8Linear):
        monkeypatch.setattr(cls, "quantized_mm", lambda self, x: ran.append(self))
    timed = []

    def fake(dense, quantized, k, dtype):
        ran.clear()
        quantized(torch.zeros(1, k, dtype=dtype))  # a step's every layer of the shape, in turn
        timed.append(list(ran))
        linear = ran[0]
        return rows[(linear.format, *linear.weight.shape)]

    monkeypatch.setattr(kernel_rows, "measure", fake)
    monkeypatch.setattr(kernel_rows, "measure_amx", lambda *a: quant.NEVER)
    table = KernelRows(torch.bfloat16, threads=1)
    quant.quantize_model(model, "int4", {}, table)
    layers = len(model.layers)
    assert sorted(len(set(map(id, peers))) for peers in timed) == [1, *[layers] * 4]
    for layer in model.layers:
        linears = (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down)
        assert [x.max_rows for x in linears] == [4, 8, 12, 16]
    assert model.lm_head.max_rows == 2
    assert model.layers[0].attn.qkv.kernel_spec()[1] == 4  # what the fused decode step is given
    amx = [name for name in table.measured if name.startswith("amx:")]  # where AMX runs
    assert len(table.measured) == 5 + len(amx) and table.path.exists()  # once a shape, saved


def test_every_few_row_linear_has_its_amx_rows_before_the_dense_crossover_is_timed(
    cache, monkeypatch
):
    """The AMX kernel moves where the quantized kernel stops beating the dense GEMM, so every
    layer of a shape (all timed together) runs from its AMX rows when max_rows is measured."""
    files = make_model_files(seed=1)
    model = LlamaModel(make_model_config(), files.weights, torch.bfloat16, torch.device("cpu"))
    monkeypatch.setattr(KernelRows, "amx_from", lambda self, fmt, layer, peers=None: 24)
    seen = []

    def fake(dense, quantized, k, dtype):
        seen.append(quantized)
        return 64

    monkeypatch.setattr(kernel_rows, "measure", fake)
    quant.quantize_model(model, "int4", {}, KernelRows(torch.bfloat16, threads=1))
    few = [lin for lin in quant.quantized_linears(model) if lin.kind in (3, 4)]
    assert few and seen and all(lin.amx_from == 24 and lin.max_rows == 64 for lin in few)
    assert all(lin.kernel_spec()[-1] == 24 for lin in few)  # what the fused decode step is given


def test_amx_rows_are_never_with_fixed_rows_and_cached_per_shape(cache, monkeypatch):
    from pdserve.model.extension import load_extension

    monkeypatch.setenv("PDSERVE_QUANT_MAX_ROWS", "16")
    assert KernelRows(torch.bfloat16, threads=2).amx_from("int4", _linear()) == quant.NEVER
    monkeypatch.delenv("PDSERVE_QUANT_MAX_ROWS")
    if not load_extension().amx_available():
        assert KernelRows(torch.bfloat16, threads=2).amx_from("int4", _linear()) == quant.NEVER
        return
    monkeypatch.setattr(kernel_rows, "measure_amx", lambda *a: 32)
    rows = KernelRows(torch.bfloat16, threads=2)
    assert rows.amx_from("int4", _linear()) == 32 and rows.measured == ["amx:int4:64x96"]


def test_row_parts_run_only_between_two_winning_ladder_counts():
    wins = (512, 768, 1024)
    assert not quant.split_here(256, wins) and not quant.split_here(511, wins)
    assert quant.split_here(512, wins) and quant.split_here(900, wins)
    assert quant.split_here(1024, wins)
    assert not quant.split_here(1025, wins)  # 1,536 did not win
    assert quant.split_here(5000, (2048,)) and not quant.split_here(5000, (1024,))


def test_a_packed_gemm_as_row_parts_gives_the_whole_gemms_values(cache):
    """Where oneDNN packs bf16 weights and the extension is built: the rows split between the
    threads give the whole GEMM's values within bf16 rounding (oneDNN may sum a smaller M in
    another order), for row counts that do not divide evenly too; the measured row counts
    are saved with the table and given to the model's packed linears."""
    from pdserve.model.extension import extension_or_none

    weight = (torch.randn(96, 64) / 8).to(torch.bfloat16)
    linear = quant.Dense(weight)
    linear.pack()
    if not linear.onednn or extension_or_none() is None:
        pytest.skip("oneDNN's packed bf16 GEMM or the C++ extension does not run here")
    for rows in (1, 255, 256, 1001):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        whole = linear.dense_mm(x)
        with torch.inference_mode():  # as the engine's steps run (the threads write the parts)
            parts = linear.row_parts_mm(x)
        assert parts.shape == whole.shape
        torch.testing.assert_close(parts.float(), whole.float(), rtol=2**-7, atol=1e-2)
    linear.split_rows = (256,)
    x = torch.randn(300, 64).to(torch.bfloat16)
    want = F.linear(x, weight).float()
    torch.testing.assert_close(linear(x).float(), want, rtol=2**-7, atol=1e-2)
    rows = KernelRows(torch.bfloat16, threads=2)
    measured = rows.split_rows(linear)
    assert set(measured) <= set(quant.SPLIT_LADDER)
    rows.save()
    assert KernelRows(torch.bfloat16, threads=2).table["split:96x64"] == list(measured)
