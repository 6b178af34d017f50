"""The parts a family adds to the shared decoder (`llama.py`), gpt-fast style: the decoder calls
them and never asks which family it runs.

* Attention parts map the fused q/k/v projection's output (T, (n_heads + 2 n_kv) * d), this
  rank's heads, before RoPE: `QKVBias` (Qwen2), `HeadQKNorm` (Qwen3: RMSNorm per head),
  `WideQKNorm` (OLMoE: RMSNorm over all of q's and all of k's heads).
* MLP parts map the normed hidden states (T, hidden) to this rank's partial output: `SwiGLU`
  (dense) and `MoE` (top-k routed experts, optionally a gated shared expert).

Linears are `quant.Dense` callables; each part lists its linears (`linears()`: attribute, HF
weight names fused in row order) so that `quant.quantize_model` can replace them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.model.quant import Dense


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 (as HF does), cast back: bf16 variance loses digits."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class QKVBias:
    """q/k/v projection biases (Qwen2, Qwen2-MoE)."""

    def __init__(self, w: dict[str, torch.Tensor], p: str):
        self.bias = torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])

    def __call__(self, qkv: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
        return qkv + self.bias


class _QKNorm:
    def __init__(self, w: dict[str, torch.Tensor], p: str, eps: float):
        self.q, self.k = w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"]
        self.eps = eps


class HeadQKNorm(_QKNorm):
    """RMSNorm of every q and k head over its head_dim (Qwen3, Qwen3-MoE)."""

    def __call__(self, qkv: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
        t, d = qkv.shape[0], self.q.shape[0]
        q = rms(qkv[:, : n_heads * d].view(t, n_heads, d), self.q, self.eps)
        k = rms(qkv[:, n_heads * d : (n_heads + n_kv) * d].view(t, n_kv, d), self.k, self.eps)
        return torch.cat([q.view(t, -1), k.view(t, -1), qkv[:, (n_heads + n_kv) * d :]], -1)


class WideQKNorm(_QKNorm):
    """RMSNorm of q over all its heads, and of k over all its heads (OLMoE): it needs every
    head on one rank, so OLMoE does not run tensor-parallel (its family says so)."""

    def __call__(self, qkv: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
        nq, nk = self.q.shape[0], self.k.shape[0]
        q, k = rms(qkv[:, :nq], self.q, self.eps), rms(qkv[:, nq : nq + nk], self.k, self.eps)
        return torch.cat([q, k, qkv[:, nq + nk :]], -1)


class SwiGLU:
    """down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(
        self, w: dict[str, torch.Tensor], p: str, names=("gate_proj", "up_proj", "down_proj")
    ):
        gate, up, down = (p + n for n in names)
        if gate + ".bias" in w:
            raise ValueError("MLP biases (config.json mlp_bias) are not supported; set it false")
        self.parts = {"gate_up": (gate, up), "down": (down,)}
        self.gate_up = Dense(torch.cat([w[gate + ".weight"], w[up + ".weight"]]))
        self.down = Dense(w[down + ".weight"])

    def linears(self):
        return [(self, attr, names) for attr, names in self.parts.items()]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class MoE:
    """Top-k routed experts: softmax over the router's logits (float32), the k largest,
    renormalised to sum to 1 when `norm_topk_prob` (Mixtral always; Qwen-MoE and OLMoE as their
    config says), plus a shared expert scaled by sigmoid(shared_gate(x)) where the family has one
    (Qwen2-MoE).

    `experts[e]` is None for an expert another rank holds (expert parallelism): this rank adds
    only its experts' rows, and the all-reduce after the MLP sums every rank's.

    Batched by expert: the (token, slot) pairs are sorted by expert, each expert with any tokens
    runs one SwiGLU over its contiguous rows, and the weighted rows are summed back per token
    with one index_add_: a Python loop over the experts that have tokens, none over tokens."""

    def __init__(self, experts: list[SwiGLU], router: torch.Tensor, top_k: int, norm_topk: bool,
                 shared: SwiGLU | None = None, shared_gate=None):  # fmt: skip
        self.experts, self.router, self.top_k, self.norm_topk = experts, router, top_k, norm_topk
        self.shared, self.shared_gate = shared, shared_gate

    def linears(self):
        out = [lin for e in self.experts if e is not None for lin in e.linears()]
        return out + (self.shared.linears() if self.shared is not None else [])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (T, k) float32, expert ids (T, k)) of every token."""
        probs = F.linear(x, self.router).float().softmax(-1)
        weights, ids = probs.topk(self.top_k, -1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // self.top_k  # the token each sorted (token, slot) pair belongs to
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows = x.index_select(0, token)
        w = weights.reshape(-1)[order].to(x.dtype)[:, None]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n and expert is not None:  # None: held by another rank, which adds its rows
                y = expert(rows[start : start + n]) * w[start : start + n]
                out.index_add_(0, token[start : start + n], y)
            start += n
        if self.shared is not None:
            gate = torch.sigmoid(F.linear(x, self.shared_gate))
            out = out + gate * self.shared(x)
        return out
