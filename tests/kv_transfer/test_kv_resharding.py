"""KV re-sharding between tensor-parallel groups (`KVLayout.segments_from`): a sender of a
prefill group of p ranks fills each rank of a decode group of d ranks with exactly that rank's KV
heads, layer by layer, over tcp (raw and fp8) and nixl, for p = d, p < d, p > d, and KV heads
replicated (a group larger than the model's KV heads). Each decode rank receives exactly the bytes
of its own heads; layouts that cannot be mapped are refused at the handshake, naming why."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer import KVLayout, KVLayoutMismatch, make_receiver, make_sender
from pdserve.kv_transfer.layout import HeadSegment

from .helpers import HAS_NIXL, NIXL_SKIP, SENTINEL, make_layout

HEADS = 4  # the model's KV heads: groups of 1, 2 and 4 split them, 8 replicates each on 2
SRC, DST = [3, 4, 5, 9, 0], [7, 1, 2, 3, 10]  # runs and single blocks, in another order
BACKENDS = [
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(not HAS_NIXL, reason=NIXL_SKIP)),
]


def group_layout(size: int, **overrides) -> KVLayout:
    """Rank 0's layout of a group of `size` ranks (the model has HEADS KV heads)."""
    return make_layout(**{"num_kv_heads": HEADS, **overrides}).split(size)


def full_cache(layout: KVLayout, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """The model's whole K (or V) cache, every head, one tensor per layer."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, layout.block_size, HEADS, layout.head_dim)
    return [torch.randn(shape, generator=gen).to(getattr(torch, layout.dtype))
            for _ in range(layout.num_layers)]  # fmt: skip


def rank_slice(full: list[torch.Tensor], layout: KVLayout) -> list[torch.Tensor]:
    heads = layout.heads
    return [t[:, :, heads.start : heads.stop].contiguous() for t in full]


def test_segments_say_which_sender_rank_fills_each_head():
    one, two, eight = group_layout(1), group_layout(2), group_layout(8)
    # p = d: rank r of each, whole
    assert two.shard(1).segments_from(two) == [HeadSegment(1, 0, 0, 2)]
    # p < d: decode rank 1 of 2 takes heads 2, 3 of the single prefill rank
    assert two.shard(1).segments_from(one) == [HeadSegment(0, 2, 0, 2)]
    # p > d: the single decode rank gathers both prefill ranks' heads
    assert one.segments_from(two) == [HeadSegment(0, 0, 0, 2), HeadSegment(1, 0, 2, 2)]
    # replicated: ranks 4 and 5 of 8 both hold head 2, from rank 1 of 2
    assert eight.shard(4).segments_from(two) == eight.shard(5).segments_from(two)
    assert eight.shard(4).segments_from(two) == [HeadSegment(1, 0, 0, 1)]
    # ...and a decode group of 2 reads replicated heads from the first rank holding each
    assert two.shard(1).segments_from(eight) == [HeadSegment(4, 0, 0, 1), HeadSegment(6, 0, 1, 1)]


def test_a_layout_that_cannot_be_mapped_is_refused_naming_why():
    with pytest.raises(KVLayoutMismatch, match="model_kv_heads: decode worker has 4, prefill "
                       "worker has 2"):  # fmt: skip
        group_layout(2).segments_from(group_layout(1, num_kv_heads=2))
    with pytest.raises(ValueError, match="size of 3 neither divides the model's 4 KV heads"):
        group_layout(3)


def push(backend: str, p: int, d: int, layout_overrides=None, **sender_opts):
    """Push every layer of blocks SRC of a prefill group of p ranks into blocks DST of a decode
    group of d ranks; return (decode layouts, their caches, the full caches, receivers' stats,
    the sender's result)."""
    send_layout = group_layout(p, **(layout_overrides or {}))
    full_k, full_v = full_cache(send_layout, 12, 1), full_cache(send_layout, 12, 2)
    ranks = [(rank_slice(full_k, send_layout.shard(r)), rank_slice(full_v, send_layout.shard(r)))
             for r in range(p)]  # fmt: skip
    sender = make_sender(backend, send_layout, *ranks[0], ranks=ranks, **sender_opts)
    receivers, caches = [], []
    for j in range(d):
        layout = group_layout(d).shard(j)
        shape = (16, layout.block_size, layout.num_kv_heads, layout.head_dim)
        k = [torch.full(shape, SENTINEL) for _ in range(layout.num_layers)]
        v = [torch.full(shape, SENTINEL) for _ in range(layout.num_layers)]
        receiver = make_receiver(backend, layout, k, v)
        receiver.start()
        receiver.expect("t", DST)
        receivers.append(receiver)
        caches.append((layout, k, v))
    try:
        for layer in range(send_layout.num_layers):
            for r in receivers:
                sender.send_layer(r.endpoint, "t", layer, SRC, DST)
        result = sender.wait("t", timeout_s=30)
        landed = [r.layers_landed("t") for r in receivers]
        stats = [r.stats() for r in receivers]
    finally:
        sender.close()
        for r in receivers:
            r.close()
    return caches, (full_k, full_v), landed, stats, result


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p, d", [(1, 1), (2, 2), (1, 2), (2, 1), (4, 2), (2, 4), (2, 8)])
def test_each_decode_rank_gets_exactly_its_heads(backend, p, d):
    caches, full, landed, stats, result = push(backend, p, d)
    assert result.ok, result.error
    layers = caches[0][0].num_layers
    assert landed == [layers] * d
    for (layout, k, v), st in zip(caches, stats, strict=True):
        heads = layout.heads
        for mine, whole in ((k, full[0]), (v, full[1])):
            for layer in range(layers):
                want = whole[layer][SRC][:, :, heads.start : heads.stop]
                assert torch.equal(mine[layer][DST], want), (layout.tp_rank, layer)
                others = sorted(set(range(16)) - set(DST))
                assert bool((mine[layer][others] == SENTINEL).all())
        # the bytes this rank received are exactly its share: its heads of every block, K and V
        assert st.bytes == layers * 2 * len(DST) * layout.block_bytes
    assert result.bytes_sent == sum(st.bytes for st in stats)


def test_fp8_compression_applies_to_gathered_heads():
    caches, full, landed, _, result = push("tcp", 2, 1, compression="fp8")
    assert result.ok, result.error
    layout, k, _ = caches[0]
    assert landed == [layout.num_layers]
    got, want = k[0][DST].float(), full[0][0][SRC].float()
    assert torch.allclose(got, want, atol=float(want.abs().max()) / 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_of_another_model_is_refused_at_the_handshake(backend):
    caches, _, landed, _, result = push(backend, 2, 1, layout_overrides=dict(head_dim=16))
    assert not result.ok
    assert "head_dim: decode worker has 8, prefill worker has 16" in result.error
    assert landed == [0]
    assert bool((caches[0][1][0] == SENTINEL).all())
