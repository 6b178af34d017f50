"""The shared decoder of every family: RMSNorm, RoPE (`rope.py`), GQA paged attention
(sliding-window where the config sets it), residuals. What a family adds (`model/registry.py`)
are parts (`parts.py`): attention parts on the q/k/v projection, the MLP (SwiGLU or experts).

Linear layers are `Dense` callables with q/k/v and gate/up fused into one matmul each; weight
formats (`quant.py`) replace them after the model is built. The KV cache and batch layout live
outside (`attention.py`); this file only computes.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.config import ModelConfig
from pdserve.model import registry
from pdserve.model.attention import AttentionMetadata, paged_attention
from pdserve.model.parts import rms
from pdserve.model.quant import Dense
from pdserve.model.rope import rope_inv_freq


class Layer(nn.Module):
    """One decoder layer: norms and attention projections, the family's attention parts (applied
    to the q/k/v projection before RoPE) and its MLP part (`parts.py`)."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], i: int, fam):
        super().__init__()
        p = f"model.layers.{i}."
        self.attn_norm = w[p + "input_layernorm.weight"]
        self.mlp_norm = w[p + "post_attention_layernorm.weight"]
        self.qkv = Dense(torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
        self.o = Dense(w[p + "self_attn.o_proj.weight"])
        self.qkv_parts = fam.attention_parts(cfg, w, p)
        self.mlp = fam.mlp(cfg, w, p, i)
        self.prefix = p

    def linears(self):
        """(owner, attribute, HF weight names fused in row order) of every linear."""
        attn = [(self, "qkv", tuple(f"{self.prefix}self_attn.{n}_proj" for n in "qkv")),
                (self, "o", (self.prefix + "self_attn.o_proj",))]  # fmt: skip
        return attn + self.mlp.linears()


class LlamaModel(nn.Module):
    """`tp`: this rank's part of a tensor-parallel model (`engine/tp/`): `weights` are its
    slices, attention runs over its heads, and the ranks' partial sums are added after the
    attention output and the MLP. None: the whole model."""

    def __init__(self, cfg: ModelConfig, weights: dict, dtype, device, tp=None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        shard = tp.shard if tp is not None else None
        self.n_heads, self.n_kv = (
            shard.local_heads(cfg) if shard else (cfg.num_heads, cfg.num_kv_heads)
        )
        if shard is not None:
            weights = shard.weights(cfg, weights)
        w = {k: torch.from_numpy(v).to(device=device, dtype=dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = Dense(self.embed if cfg.tie_word_embeddings else w["lm_head.weight"])
        self.family = registry.family(cfg.architecture)
        self.layers = [Layer(cfg, w, i, self.family) for i in range(cfg.num_layers)]
        freqs = weights.get("rope_freqs")
        inv, scale = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, freqs)
        t = torch.arange(cfg.max_position_embeddings, device=device, dtype=torch.float32)
        angles = torch.outer(t, inv.to(device))  # (max_pos, d/2)
        self.cos = (torch.cat([angles.cos()] * 2, -1) * scale).to(dtype)  # (max_pos, d)
        # The sign of rotate_half folded in: rope(x) = x * cos + swap_halves(x) * sin.
        self.sin = (torch.cat([-angles.sin(), angles.sin()], -1) * scale).to(dtype)
        self.dtype = dtype

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms(x, weight, self.cfg.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """HF's x * cos + rotate_half(x) * sin in three ops: `sin` carries rotate_half's sign."""
        half = x.shape[-1] // 2
        swapped = torch.cat([x[..., half:], x[..., :half]], -1)
        return torch.addcmul(x * cos, swapped, sin)

    def _attention(self, layer: Layer, x, cos, sin, kv, meta: AttentionMetadata):
        cfg = self.cfg
        t, d = x.shape[0], cfg.head_dim
        qkv = layer.qkv(x)
        for part in layer.qkv_parts:
            qkv = part(qkv, self.n_heads, self.n_kv)
        n_qk = self.n_heads + self.n_kv
        # RoPE over the q and k heads at once: one pass of each op instead of two (prefill).
        qk = self._rope(qkv[:, : n_qk * d].view(t, n_qk, d), cos, sin)
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]  # (T, n_heads, d), (T, n_kv, d)
        v = qkv[:, n_qk * d :].view(t, self.n_kv, d)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, cfg.sliding_window)
        return self._reduce(layer.o(o.reshape(t, self.n_heads * d)))

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else self.tp.all_reduce(x)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states (T, hidden) for a flat batch; writes every token's K/V into kv_caches,
        a list of (k_cache, v_cache) per layer."""
        x = self.embed[input_ids]
        cos = self.cos[positions].unsqueeze(1)  # (T, 1, d): broadcast over heads
        sin = self.sin[positions].unsqueeze(1)
        for i, layer in enumerate(self.layers):
            if meta.before_layer is not None:
                meta.before_layer(i)
            x = x + self._attention(
                layer, self._rms(x, layer.attn_norm), cos, sin, kv_caches[i], meta
            )
            x = x + self._reduce(layer.mlp(self._rms(x, layer.mlp_norm)))
            if meta.layer_hook is not None:
                meta.layer_hook(i)
        return self._rms(x, self.norm)

    def linears(self) -> list[Dense]:
        """Every layer's linears (attention, MLP or experts), lm_head left out."""
        return [getattr(o, a) for layer in self.layers for o, a, _ in layer.linears()]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
