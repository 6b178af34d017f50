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
    ep: int = 1  # expert-parallel groups: each holds num_experts / ep experts, over size / ep ranks

    def check(self, cfg) -> None:
        """ValueError naming what does not split, and the sizes that would."""
        from pdserve.model import registry

        n, heads, kv = self.size, cfg.num_heads, cfg.num_kv_heads
        if n > 1 and (why := registry.family(cfg.architecture).tp_refusal(cfg)) is not None:
            raise ValueError(
                f"--tensor-parallel-size {n}: {cfg.architecture} does not run tensor-parallel "
                f"({why}); use --tensor-parallel-size 1"
            )
        self._check_ep(cfg)
        widths = [w for w in _mlp_widths(cfg) if w]
        ok = [
            k
            for k in range(1, heads + 1)
            if heads % k == 0 and all(w % k == 0 for w in widths) and (kv % k == 0 or k % kv == 0)
        ]
        ranks = n // self.ep  # the ranks each expert is split over
        if cfg.is_moe and cfg.moe_intermediate_size % ranks:
            raise ValueError(
                f"--tensor-parallel-size {n} with --expert-parallel-size {self.ep} splits each "
                f"expert (width {cfg.moe_intermediate_size}) over {ranks} ranks, which does not "
                "divide it; raise --expert-parallel-size (whole experts per rank) or lower the TP"
            )
        if n not in ok:
            raise ValueError(
                f"--tensor-parallel-size {n} does not split this model ({heads} query heads, "
                f"{kv} KV heads, MLP width {'/'.join(map(str, widths))}): the query heads and "
                f"the MLP widths must divide by it, and the KV heads divide by it or it by them "
                f"(then each is replicated); sizes that work: {', '.join(map(str, ok))}"
            )

    def _check_ep(self, cfg) -> None:
        if self.ep == 1:
            return
        if not cfg.is_moe:
            raise ValueError(
                f"--expert-parallel-size {self.ep}: {cfg.architecture} is a dense model (no "
                "experts to split); use --tensor-parallel-size alone"
            )
        if cfg.num_experts % self.ep:
            sizes = [k for k in range(1, self.size + 1) if self.size % k == 0
                     and cfg.num_experts % k == 0]  # fmt: skip
            raise ValueError(
                f"--expert-parallel-size {self.ep} does not divide the {cfg.num_experts} experts; "
                f"sizes that work with --tensor-parallel-size {self.size}: "
                f"{', '.join(map(str, sizes))}"
            )

    def experts(self, cfg) -> range:
        """The experts this rank holds (each split by width over size / ep ranks)."""
        per_group, ranks = cfg.num_experts // self.ep, self.size // self.ep
        group = self.rank // ranks
        return range(group * per_group, (group + 1) * per_group)

    def local_heads(self, cfg) -> tuple[int, int]:
        """(query heads, KV heads) on this rank."""
        return cfg.num_heads // self.size, max(1, cfg.num_kv_heads // self.size)

    def kv_heads(self, cfg) -> range:
        """The model's KV heads this rank holds (replicated ones: size/kv ranks share one)."""
        return kv_head_range(self.rank, self.size, cfg.num_kv_heads)

    def weights(self, cfg, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This rank's slices of the layers' weights: q/k/v rows (and biases) by head, o_proj
        columns; every MLP's (dense, each expert's, the shared expert's) gate/up rows and down
        columns by its own width. Norms, routers and the rest are replicated. For multi-head
        latent attention, q (q_proj or q_b_proj) and kv_b_proj rows by head, o_proj columns:
        the latent's projections (q_a_proj, kv_a_proj_with_mqa) are replicated, as the latent
        cache is."""
        if self.size == 1:
            return weights
        d, r, n = cfg.head_dim, self.rank, self.size
        q_heads = cfg.num_heads // n

        def heads(width: int) -> slice:  # this rank's heads of `width` rows (or columns) each
            return slice(r * q_heads * width, (r + 1) * q_heads * width)

        q = heads(cfg.qk_nope_head_dim + d if cfg.is_mla else d)
        o = heads(cfg.v_head_dim) if cfg.is_mla else q
        kv_heads = self.kv_heads(cfg)
        kv = slice(kv_heads.start * d, kv_heads.stop * d)
        mine = self.experts(cfg) if cfg.is_moe else range(0)
        ranks, sub = self.size // self.ep, self.rank % (self.size // self.ep)  # within the group
        out = dict(weights)
        for name, w in weights.items():
            kind = name.rsplit(".", 2)[-2] if name.startswith("model.layers.") else None
            if (e := _expert_of(name)) is not None:  # split by width over its group's ranks
                if e not in mine:
                    del out[name]
                elif kind in _MLP_ROWS:
                    f = w.shape[0] // ranks
                    out[name] = w[sub * f : (sub + 1) * f]
                else:
                    f = w.shape[1] // ranks
                    out[name] = np.ascontiguousarray(w[:, sub * f : (sub + 1) * f])
                continue
            if kind in ("q_proj", "q_b_proj"):
                out[name] = w[q]
            elif kind in ("k_proj", "v_proj"):
                out[name] = w[kv]
            elif kind == "kv_b_proj":
                out[name] = w[heads(cfg.qk_nope_head_dim + cfg.v_head_dim)]
            elif kind == "o_proj":
                out[name] = np.ascontiguousarray(w[:, o])
            elif kind in _MLP_ROWS:
                f = w.shape[0] // n
                out[name] = w[r * f : (r + 1) * f]
            elif kind in _MLP_COLS:
                f = w.shape[1] // n
                out[name] = np.ascontiguousarray(w[:, r * f : (r + 1) * f])
        return out


_MLP_ROWS = ("gate_proj", "up_proj", "w1", "w3")  # HF names (Mixtral's experts: w1, w3, w2)
_MLP_COLS = ("down_proj", "w2")


def _expert_of(name: str) -> int | None:
    """The expert a weight belongs to (`...experts.{e}.<proj>.weight`), else None."""
    parts = name.split(".")
    if "experts" in parts:
        return int(parts[parts.index("experts") + 1])
    return None


def _mlp_widths(cfg) -> tuple[int, ...]:
    """The widths tensor parallelism splits: the dense MLP, an expert's, the shared expert's."""
    dense = cfg.intermediate_size if not cfg.is_moe or cfg.dense_layers else 0
    return dense, cfg.shared_expert_intermediate_size
