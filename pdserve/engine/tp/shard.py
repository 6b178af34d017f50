"""Which slice of a model one rank of a tensor-parallel engine holds (Megatron-style: query and
KV heads, MLP columns; KV heads replicated when the size is a multiple of them), and the checks
that refuse a split that does not work, naming the sizes that would."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.kv_transfer.layout import kv_head_range


@dataclass(frozen=True)
class TPShard:
    """Which slice of the model rank `rank` of `size` holds."""

    rank: int = 0
    size: int = 1

    def check(self, cfg) -> None:
        """ValueError naming what does not split, and the sizes that would."""
        n, heads, kv, ffn = self.size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        ok = [
            k
            for k in range(1, heads + 1)
            if heads % k == 0 and ffn % k == 0 and (kv % k == 0 or k % kv == 0)
        ]
        if n not in ok:
            raise ValueError(
                f"--tensor-parallel-size {n} does not split this model ({heads} query heads, "
                f"{kv} KV heads, MLP width {ffn}): the query heads and the MLP width must divide "
                f"by it, and the KV heads divide by it or it by them (then each is replicated); "
                f"sizes that work: {', '.join(map(str, ok))}"
            )

    def local_heads(self, cfg) -> tuple[int, int]:
        """(query heads, KV heads) on this rank."""
        return cfg.num_heads // self.size, max(1, cfg.num_kv_heads // self.size)

    def kv_heads(self, cfg) -> range:
        """The model's KV heads this rank holds (replicated ones: size/kv ranks share one)."""
        return kv_head_range(self.rank, self.size, cfg.num_kv_heads)

    def weights(self, cfg, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This rank's slices of the layers' weights (others unchanged)."""
        if self.size == 1:
            return weights
        d, r, n = cfg.head_dim, self.rank, self.size
        q_heads = cfg.num_heads // n
        q = slice(r * q_heads * d, (r + 1) * q_heads * d)
        kv_heads = self.kv_heads(cfg)
        kv = slice(kv_heads.start * d, kv_heads.stop * d)
        f = cfg.intermediate_size // n
        ffn = slice(r * f, (r + 1) * f)
        rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
                "mlp.gate_proj": ffn, "mlp.up_proj": ffn}  # fmt: skip
        cols = {"self_attn.o_proj": q, "mlp.down_proj": ffn}
        out = dict(weights)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            for name, s in rows.items():
                out[p + name + ".weight"] = weights[p + name + ".weight"][s]
            for name, s in cols.items():
                out[p + name + ".weight"] = np.ascontiguousarray(
                    weights[p + name + ".weight"][:, s]
                )
        return out
