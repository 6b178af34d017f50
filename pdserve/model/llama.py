"""The shared decoder of every family: embeddings, RMSNorm, RoPE tables (`rope.py`), residuals,
the head. What a family adds (`model/registry.py`) are parts: its attention (`parts.GQA`, paged
GQA attention with parts on the q/k/v projection, sliding-window where the config sets it; or
`mla.MLA`, multi-head latent attention) and its MLP (`parts.py`: SwiGLU or experts).

Linear layers are `Dense` callables with q/k/v and gate/up fused into one matmul each; weight
formats (`quant.py`) replace them after the model is built. The KV cache and batch layout live
outside (`attention.py`); this file only computes.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.config import ModelConfig
from pdserve.model import registry
from pdserve.model.attention import AttentionMetadata
from pdserve.model.parts import add_rms, rms
from pdserve.model.quant import Dense, prompt_rows
from pdserve.model.rope import rope_inv_freq


class Layer(nn.Module):
    """One decoder layer: norms, the family's attention part (`parts.GQA` with its parts on the
    q/k/v projection, or `mla.MLA`) and its MLP part (`parts.py`)."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], i: int, fam):
        super().__init__()
        p = f"model.layers.{i}."
        self.attn_norm = w[p + "input_layernorm.weight"]
        self.mlp_norm = w[p + "post_attention_layernorm.weight"]
        self.attn = fam.attention(cfg, w, p)
        self.mlp = fam.mlp(cfg, w, p, i)

    def linears(self):
        """(owner, attribute, HF weight names fused in row order) of every linear."""
        return self.attn.linears() + self.mlp.linears()


class LlamaModel(nn.Module):
    """`tp`: this rank's part of a tensor-parallel model (`engine/tp/`): `weights` are its
    slices, attention runs over its heads, and the ranks' partial sums are added after the
    attention output and the MLP. None: the whole model.

    `layers`: the layers this process holds (a pipeline stage's, `engine/pp/`); None: all.
    A stage that does not hold layer 0 is given no embeddings and no head (`embed`, `lm_head`
    None): it only runs `run_layers`."""

    def __init__(self, cfg: ModelConfig, weights: dict, dtype, device, tp=None, layers=None):
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
        self.embed = w.get("model.embed_tokens.weight")
        self.norm = w.get("model.norm.weight")
        head = self.embed if cfg.tie_word_embeddings else w.get("lm_head.weight")
        self.lm_head = Dense(head) if head is not None else None
        self.family = registry.family(cfg.architecture)
        self.layer_ids = layers if layers is not None else range(cfg.num_layers)
        self.layers = [Layer(cfg, w, i, self.family) for i in self.layer_ids]
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

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else self.tp.all_reduce(x)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states (T, hidden) for a flat batch; writes every token's K/V into kv_caches,
        per layer (k_cache, v_cache), or (latent_cache,) for MLA."""
        x = self.run_layers(self.embed[input_ids], positions, kv_caches, meta)
        return self._rms(x, self.norm)

    def run_layers(self, x, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """This process's layers over hidden states `x` (T, hidden) (the residual stream, before
        the final norm); `kv_caches` indexed by the model's layer number."""
        cos = self.cos[positions].unsqueeze(1)  # (T, 1, d): broadcast over heads (d: RoPE's)
        sin = self.sin[positions].unsqueeze(1)
        with prompt_rows(any(span.prompt for span in meta.prefills)):
            return self._layers(x, cos, sin, kv_caches, meta)

    def _layers(self, x, cos, sin, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        eps, mlp_out = self.cfg.rms_norm_eps, None
        for i, layer in zip(self.layer_ids, self.layers, strict=True):
            if meta.before_layer is not None:
                meta.before_layer(i)
            if mlp_out is None:
                h = self._rms(x, layer.attn_norm)
            else:  # the last layer's residual add and this one's norm in one pass
                x, h = add_rms(x, mlp_out, layer.attn_norm, eps)
            a = self._reduce(layer.attn(h, cos, sin, kv_caches[i], meta, self.n_heads, self.n_kv))
            x, h = add_rms(x, a, layer.mlp_norm, eps)
            mlp_out = self._reduce(layer.mlp(h))
            if meta.layer_hook is not None:
                meta.layer_hook(i)
        return x if mlp_out is None else x + mlp_out

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self._rms(x, self.norm)

    def linears(self) -> list[Dense]:
        """Every layer's linears (attention, MLP or experts), lm_head left out."""
        return [getattr(o, a) for layer in self.layers for o, a, _ in layer.linears()]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
