"""Factories for KV transfer tests: tiny layouts, random caches, connected sender/receiver pairs."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pdserve.kv_transfer import KVLayout, make_receiver, make_sender

SENTINEL = -7.0  # exactly representable in every cache dtype; marks blocks nothing may touch
HAS_NIXL = any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12", "nixl_cu13"))
NIXL_SKIP = "NIXL is not installed (pip install nixl-cu12==1.5.1; `make test` installs it)"


def make_layout(dtype: str = "float32", **overrides) -> KVLayout:
    fields = dict(
        model_fingerprint="tiny-llama-test",
        dtype=dtype,
        num_layers=3,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
    )
    fields.update(overrides)
    return KVLayout(**fields)


def make_caches(
    layout: KVLayout, num_blocks: int, seed: int | None = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random caches (seeded), or all-SENTINEL ones when `seed` is None."""
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    dtype = getattr(torch, layout.dtype)
    gen = torch.Generator().manual_seed(seed or 0)

    def one() -> torch.Tensor:
        if seed is None:
            return torch.full(shape, SENTINEL, dtype=dtype)
        return torch.randn(shape, generator=gen).to(dtype)

    k = [one() for _ in range(layout.num_layers)]
    v = [one() for _ in range(layout.num_layers if layout.tensors == 2 else 0)]  # latent: no V
    return k, v


BACKENDS = [
    "tcp",
    "inproc",
    pytest.param("nixl", marks=pytest.mark.skipif(not HAS_NIXL, reason=NIXL_SKIP)),
]


class Pair:
    """A started receiver (all-SENTINEL caches) and a sender (random caches) of one backend."""

    def __init__(self, backend: str, layout: KVLayout, src_blocks=32, dst_blocks=48, **opts):
        self.layout = layout
        self.src_k, self.src_v = make_caches(layout, src_blocks, seed=1)
        self.dst_k, self.dst_v = make_caches(layout, dst_blocks, seed=None)
        self.receiver = make_receiver(backend, layout, self.dst_k, self.dst_v,
                                      **opts.get("receiver", {}))  # fmt: skip
        self.receiver.start()
        self.sender = make_sender(backend, layout, self.src_k, self.src_v, **opts.get("sender", {}))

    def send_all(self, tid: str, src: list[int], dst: list[int], layers=None) -> None:
        for layer in layers if layers is not None else range(self.layout.num_layers):
            self.sender.send_layer(self.receiver.endpoint, tid, layer, src, dst)

    def landed_equal(self, layer: int, src: list[int], dst: list[int]) -> bool:
        """Destination blocks of `layer` are bit-identical to the source blocks."""
        return all(
            torch.equal(d[layer][dst].view(torch.uint8), s[layer][src].view(torch.uint8))
            for s, d in ((self.src_k, self.dst_k), (self.src_v, self.dst_v))
            if d  # an MLA latent layout has no V
        )

    def untouched(self, blocks: list[int], layers=None) -> bool:
        """Every given destination block still holds only SENTINEL."""
        layers = layers if layers is not None else range(self.layout.num_layers)
        return all(
            bool((caches[layer][blocks] == SENTINEL).all())
            for caches in (self.dst_k, self.dst_v)
            if caches
            for layer in layers
        )

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (*self.dst_k, *self.dst_v)]

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


def receive_in_child(backend: str, layout: KVLayout, commands, replies) -> None:
    """Spawned decode side: a receiver with SENTINEL caches (32 blocks) driven by `commands`."""
    k, v = make_caches(layout, 32, seed=None)
    receiver = make_receiver(backend, layout, k, v)
    receiver.start()
    replies.put(receiver.endpoint)
    while (cmd := commands.get())[0] != "stop":
        if cmd[0] == "expect":
            receiver.expect(cmd[1], cmd[2])
            replies.put("ok")
        elif cmd[0] == "check":  # (layers landed, bit-identical, others untouched)
            _, tid, src, dst, seed = cmd
            src_k, src_v = make_caches(layout, 16, seed=seed)
            same = all(
                torch.equal(d[layer][dst].view(torch.uint8), s[layer][src].view(torch.uint8))
                for s, d in ((src_k, k), (src_v, v))
                for layer in range(layout.num_layers)
            )
            others = sorted(set(range(32)) - set(dst))
            untouched = all(bool((c[others] == SENTINEL).all()) for c in (*k, *v))
            replies.put((receiver.layers_landed(tid), same, untouched))
    receiver.close()
