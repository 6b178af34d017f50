"""Optional FP8 on-the-wire compression of the tcp connector."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer import make_sender
from pdserve.kv_transfer.fp8 import decode_into, encode

from .helpers import HAS_NIXL, NIXL_SKIP, make_caches, make_layout


def _within_fp8_error(got: torch.Tensor, want: torch.Tensor) -> bool:
    """e4m3 keeps 3 mantissa bits: each value is off by at most 1/16 of its block's max."""
    got, want = got.float().flatten(1), want.float().flatten(1)
    amax = want.abs().amax(dim=1, keepdim=True)
    return bool(((got - want).abs() <= amax / 16).all())


def test_encode_decode_roundtrip_is_close_and_exact_for_zeros():
    layout = make_layout("bfloat16")
    (k, *_), _ = make_caches(layout, 4)
    k[3].zero_()
    out = torch.full_like(k, -7.0)
    scales, data = encode(k, [0, 3, 2])
    assert data.dtype == torch.uint8 and tuple(data.shape) == (3, 64)
    decode_into(out, [1, 3, 0], scales, data)
    assert _within_fp8_error(out[[1, 0]], k[[0, 2]])
    assert not torch.equal(out[1], k[0])  # lossy: bf16 has more mantissa bits than e4m3
    assert bool((out[3] == 0).all()) and bool((out[2] == -7.0).all())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tcp_fp8_transfer_lands_within_error_and_halves_the_bytes(dtype, make_pair):
    pair = make_pair("tcp", make_layout(dtype), sender={"compression": "fp8"})
    src, dst = [5, 0, 9, 10], [44, 1, 2, 3]
    pair.receiver.expect("c", dst)
    pair.send_all("c", src, dst)
    result = pair.sender.wait("c", 10)
    assert result.ok, result.error
    assert result.bytes_sent == 3 * 2 * 4 * (4 + 64)  # scale + one byte per element
    raw = 3 * 2 * 4 * pair.layout.block_bytes
    assert result.bytes_sent / raw == {"bfloat16": 68 / 128, "float32": 68 / 256}[dtype]
    assert pair.receiver.layers_landed("c") == 3
    for layer in range(3):
        assert _within_fp8_error(pair.dst_k[layer][dst], pair.src_k[layer][src])
        assert _within_fp8_error(pair.dst_v[layer][dst], pair.src_v[layer][src])
    assert pair.untouched(sorted(set(range(48)) - set(dst)))
    pair.send_all("nobody", [1], [7], layers=[0])  # refused compressed data is skipped whole
    assert "not expected" in pair.sender.wait("nobody", 10).error
    pair.receiver.expect("d", [7])
    pair.send_all("d", [1], [7])
    assert pair.sender.wait("d", 10).ok  # the stream is still in step


def test_tcp_fp8_moves_a_latent_cache(make_pair):
    """FP8 on the wire applies to an MLA latent as to K and V: one scale and one byte per
    value of each block, the latent alone."""
    layout = make_layout("bfloat16", num_kv_heads=1, head_dim=40, cache="latent")
    pair = make_pair("tcp", layout, sender={"compression": "fp8"})
    src, dst = [5, 0, 9], [44, 1, 2]
    pair.receiver.expect("m", dst)
    pair.send_all("m", src, dst)
    result = pair.sender.wait("m", 10)
    assert result.ok, result.error
    assert result.bytes_sent == 3 * 3 * (4 + 4 * 40)  # layers x blocks x (scale + values)
    for layer in range(3):
        assert _within_fp8_error(pair.dst_k[layer][dst], pair.src_k[layer][src])
    assert pair.untouched(sorted(set(range(48)) - set(dst)))


def test_compression_options_are_checked():
    layout = make_layout()
    caches = make_caches(layout, 2)
    with pytest.raises(ValueError, match="unknown KV compression 'zstd'"):
        make_sender("tcp", layout, *caches, compression="zstd")
    if not HAS_NIXL:
        pytest.skip(NIXL_SKIP)
    with pytest.raises(ValueError, match="compression is tcp-only"):
        make_sender("nixl", layout, *caches, compression="fp8")
