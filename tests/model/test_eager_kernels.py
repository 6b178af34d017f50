"""The extension's one-pass RMSNorm, residual add + RMSNorm, RoPE and SwiGLU for a bf16
prefill's rows (model/extension.py `eager_kernels`, csrc/prefill_attention.h, csrc/decode.cpp)
against the torch ops they replace."""

import pytest
import torch

from pdserve.model import extension, parts, rope


def _torch_rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _torch_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat([x[..., half:], x[..., :half]], -1), sin)


def test_rms_norm_rounds_as_torch_does(ext):
    """Its float sum of squares runs in another order: a value one bf16 step apart, rarely."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 576, generator=g) * 3).to(torch.bfloat16)
    w = (torch.rand(576, generator=g) + 0.5).to(torch.bfloat16)
    ours, ref = ext.rms_norm(x, w, 1e-5).float(), _torch_rms(x, w, 1e-5).float()
    assert ((ours - ref).abs() <= 2**-7 * ref.abs()).all()
    assert (ours != ref).float().mean().item() < 1e-3


def test_add_rms_norm_is_torch_s_add_then_the_kernel_s_norm(ext):
    g = torch.Generator().manual_seed(2)
    x, d = ((torch.randn(130, 576, generator=g) * 3).to(torch.bfloat16) for _ in range(2))
    w = (torch.rand(576, generator=g) + 0.5).to(torch.bfloat16)
    before = x.clone()
    s, h = ext.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(s, x + d) and torch.equal(h, ext.rms_norm(x + d, w, 1e-5))
    assert torch.equal(x, before)  # the residual stream it was given is left as it was
    with pytest.raises(RuntimeError, match="add_rms_norm: bf16 rows"):
        ext.add_rms_norm(x, d[:, :64], w, 1e-5)


@pytest.mark.parametrize("rows", [1, 64, 300])
def test_swiglu_rounds_as_torch_s_silu_times_up(ext, rows):
    """bf16(silu(gate)) * up: its exp and division give a float a bit or two apart from torch's
    now and then, so a bf16 value one step apart, rarely (~2 in 10^6 on these inputs); its exp
    clamps at 88 where torch's overflows (silu(-100) ~ -1e-36 rather than -0)."""
    g = torch.Generator().manual_seed(rows)
    gu = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(torch.bfloat16)
    gu[0, :8] = torch.tensor([0.0, -0.0, 100, -100, 88.5, -88.5, 1e-30, -1e-30])
    gate, up = gu.chunk(2, -1)
    ours, ref = ext.swiglu(gu).float(), (torch.nn.functional.silu(gate) * up).float()
    assert ours.shape == (rows, 1536)
    assert ((ours - ref).abs() <= 2**-6 * ref.abs() + 1e-30).all()  # a step of silu, times up
    ours[0, :8] = ref[0, :8]  # the edge values above (a clamped exp): ~1e-36 apart at most
    assert (ours != ref).float().mean().item() < 1e-4


def test_rope_gives_torch_s_bits_on_views_of_the_projection(ext):
    g = torch.Generator().manual_seed(1)
    rows, heads, d = 100, 12, 64
    qkv = torch.randn(rows, (heads + 3) * d, generator=g).to(torch.bfloat16)
    x = qkv[:, : heads * d].view(rows, heads, d)  # as GQA passes q and k: strided rows
    angles = torch.rand(rows, d // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(torch.bfloat16)[:, None]
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(torch.bfloat16)[:, None]
    assert torch.equal(ext.rope(x, cos, sin), _torch_rope(x, cos, sin))


def test_only_a_bf16_prefill_s_rows_take_them(ext, monkeypatch):
    many = torch.zeros(extension.EAGER_MIN_ROWS, 64, dtype=torch.bfloat16)
    assert extension.eager_kernels(many) is ext
    assert extension.eager_kernels(many[:-1]) is None  # a decode step's few rows
    assert extension.eager_kernels(many.float()) is None  # float32 keeps torch's bits
    calls = []
    monkeypatch.setattr(ext, "rms_norm", lambda *a: calls.append("rms") or _torch_rms(*a))
    x = torch.randn(80, 64).to(torch.bfloat16)
    parts.rms(x, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    cos = torch.ones(80, 1, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(ext, "rope", lambda *a: calls.append("rope") or _torch_rope(*a))
    rope.apply_rope(x.view(80, 1, 64), cos, cos)
    monkeypatch.setattr(ext, "add_rms_norm", lambda x, d, w, e: calls.append("add") or (x, x))
    parts.add_rms(x, x, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    few = x[: extension.EAGER_MIN_ROWS - 1]
    s, h = parts.add_rms(few, few, torch.ones(64, dtype=torch.bfloat16), 1e-5)  # torch's ops
    assert torch.equal(s, few + few) and torch.equal(
        h, _torch_rms(few + few, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    )
    assert calls == ["rms", "rope", "add"]


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152, 49157])
def test_argmax_rows_picks_what_torch_picks(ext, vocab):
    """The greedy sampler's argmax (engine/sampler.py): the first of equal largest values, the
    first NaN where a row has one, rows of -inf, every vocabulary width (the vector loop's tail)."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1] = torch.round(x[1])  # many ties
    x[2] = float("-inf")
    if vocab > 10:
        x[0, 3] = x[0, vocab - 2] = x[0].max() + 1  # a tie far apart
        x[3, vocab // 2] = x[3, vocab - 1] = float("nan")
        x[4, vocab - 1] = float("nan")  # in the tail
    assert torch.equal(ext.argmax_rows(x), x.argmax(-1))


def test_the_greedy_sampler_uses_the_kernel_once_loaded(ext, monkeypatch):
    from pdserve.engine import sampler

    calls = []
    monkeypatch.setattr(sampler, "loaded_or_none", lambda: calls.append(1) or ext)
    x = torch.randn(4, 100)
    assert sampler.argmax_rows(x) == x.argmax(-1).tolist() and calls
    monkeypatch.setattr(sampler, "loaded_or_none", lambda: None)
    assert sampler.argmax_rows(x) == x.argmax(-1).tolist()
