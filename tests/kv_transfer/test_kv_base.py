"""KVLayout, the registry, and small helpers."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from pdserve.kv_transfer import KVLayout, KVLayoutMismatch, make_receiver, make_sender
from pdserve.kv_transfer.memory import Run, layout_of, paired_runs
from pdserve.kv_transfer.wire import is_loopback, parse_endpoint

from .helpers import make_caches, make_layout


def test_layout_mismatch_names_every_differing_field_with_both_values():
    a = make_layout()
    b = make_layout(model_fingerprint="other", num_layers=4, head_dim=16)
    with pytest.raises(KVLayoutMismatch) as info:
        a.check_compatible(b, mine="decode", theirs="prefill")
    assert str(info.value) == (
        "KV layout mismatch between prefill and decode workers (model_fingerprint: decode has "
        "'tiny-llama-test', prefill has 'other'; num_layers: decode has 3, prefill has 4; "
        "head_dim: decode has 8, prefill has 16). Start both workers with the same model, "
        "KV cache dtype and block size."
    )
    assert isinstance(info.value, ValueError)
    a.check_compatible(make_layout())  # equal layouts pass


def test_layout_validation_and_sizes():
    layout = make_layout("bfloat16")
    assert layout.block_bytes == 4 * 2 * 8 * 2
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(layout), type=KVLayout) == layout
    assert make_layout("int8").block_bytes == 4 * 2 * 8  # rows of --kv-cache-dtype int8
    with pytest.raises(ValueError, match="'uint8' is not supported; use one of float32"):
        make_layout("uint8")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        make_layout(block_size=0)


def test_layout_of_engine_caches():
    layout = make_layout("bfloat16")
    k, _ = make_caches(layout, 5)
    assert layout_of("tiny-llama-test", k) == layout


def test_cache_shapes_are_checked_against_the_layout():
    layout = make_layout()
    k, v = make_caches(make_layout(head_dim=4), 3)
    with pytest.raises(ValueError, match=r"shape \(3, 4, 2, 4\).*needs \(3, 4, 2, 8\)"):
        make_sender("inproc", layout, k, v)


def test_registry_rejects_unknown_backends_listing_the_known_ones():
    with pytest.raises(ValueError, match="unknown KV transfer backend 'rdma'; available: tcp, "):
        make_receiver("rdma", make_layout(), [], [])


def test_package_import_does_not_load_torch():
    code = "import sys, pdserve.kv_transfer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_paired_runs_split_where_either_side_breaks():
    assert paired_runs([5, 6, 7, 1, 2], [10, 11, 20, 21, 22]) == [
        Run(5, 10, 2),
        Run(7, 20, 1),
        Run(1, 21, 2),
    ]
    assert paired_runs([], []) == []


def test_endpoints_and_loopback():
    assert parse_endpoint("tcp://127.0.0.1:5000", "tcp") == ("127.0.0.1", 5000)
    assert parse_endpoint("tcp://[::1]:5000", "tcp") == ("::1", 5000)
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        parse_endpoint("nixl://127.0.0.1:5000", "tcp")
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "db")] == [
        True,
        True,
        True,
        False,
        False,
    ]


def test_a_latent_layout_is_one_tensor_per_layer_whole_on_every_rank():
    """MLA's latent: one tensor per layer of one "head", which every rank of a tensor-parallel
    group holds whole (a TP 2 receiver's blocks come whole from rank 0 of a TP 1 sender)."""
    from pdserve.kv_store.mooncake import open_store_client
    from pdserve.kv_transfer.layout import HeadSegment, whole_rank
    from pdserve.kv_transfer.memory import check_caches

    k, v = make_caches(make_layout(num_kv_heads=1, head_dim=40, cache="latent"), 4)
    layout = layout_of("m", k, latent=True)
    assert v == [] and layout.cache == "latent" and layout.tensors == 1
    assert layout.block_bytes == 4 * 40 * 4  # block_size x (kv_lora_rank + rope dims) x fp32
    ranks = [layout.split(2, r) for r in range(2)]
    assert [r.heads for r in ranks] == [range(0, 1)] * 2 and ranks[1].num_kv_heads == 1
    segments = ranks[1].segments_from(layout)
    assert segments == [HeadSegment(0, 0, 0, 1)] and whole_rank(segments, ranks[1], layout) == 0
    with pytest.raises(ValueError, match="expected 3 latent cache tensors and no V"):
        check_caches(layout, k, k)
    with pytest.raises(ValueError, match="a latent KV cache has one head, not 2"):
        KVLayout("m", "float32", 1, 4, 2, 8, cache="latent")
    with pytest.raises(ValueError, match="a Mooncake pool holds per-head K/V blocks here"):
        open_store_client("mooncake://127.0.0.1:1", layout, k, v)
