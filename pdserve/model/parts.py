"""The parts a family adds to the shared decoder (`llama.py`), gpt-fast style: the decoder calls
them and never asks which family it runs.

* The attention part maps the normed hidden states (T, hidden) to this rank's partial output,
  writing the step's KV into the cache: `GQA` (K and V per KV head; the shared default) or
  `mla.MLA` (DeepSeek's latent). GQA's own parts map its fused q/k/v projection's output
  (T, (n_heads + 2 n_kv) * d), this rank's heads, before RoPE: `QKVBias` (Qwen2), `HeadQKNorm`
  (Qwen3: RMSNorm per head), `WideQKNorm` (OLMoE: RMSNorm over all of q's and all of k's heads).
* MLP parts map the normed hidden states (T, hidden) to this rank's partial output: `SwiGLU`
  (dense), `MoE` (top-k routed experts, optionally a gated shared expert) and `GroupedTopK`
  (DeepSeek's routing over the same batched experts).

Linears are `quant.Dense` callables; each part lists its linears (`linears()`: attribute, HF
weight names fused in row order) so that `quant.quantize_model` can replace them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.model.attention import KERNEL_QUERIES, AttentionMetadata, paged_attention
from pdserve.model.extension import eager_kernels
from pdserve.model.quant import Dense
from pdserve.model.rope import apply_rope


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 (as HF does), cast back: bf16 variance loses digits. A bf16
    prefill's rows take the extension's one pass (the same rounding)."""
    ext = eager_kernels(x)
    if ext is not None and x.dim() == 2 and x.shape[1] % 16 == 0 and weight.dtype == x.dtype:
        return ext.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream x + delta and its RMSNorm (`rms`); a bf16 prefill's rows in one
    pass of the extension (the same rounding)."""
    ext = eager_kernels(x)
    if (
        ext is not None
        and x.dim() == 2
        and x.shape == delta.shape
        and delta.dtype == x.dtype
        and x.shape[1] % 16 == 0
        and weight.dtype == x.dtype
    ):
        return tuple(ext.add_rms_norm(x, delta, weight, eps))
    x = x + delta
    return x, rms(x, weight, eps)


class GQA:
    """The shared decoder's attention: q/k/v in one matmul, the family's `parts` on its output,
    RoPE over the q and k heads at once (one pass of each op instead of two), paged GQA
    attention (sliding-window where the config sets it), o_proj."""

    def __init__(self, cfg, w: dict[str, torch.Tensor], p: str, parts: list):
        a = p + "self_attn."
        self.qkv = Dense(torch.cat([w[f"{a}{n}_proj.weight"] for n in "qkv"]))
        self.o = Dense(w[a + "o_proj.weight"])
        self.parts, self.prefix = parts, a
        self.head_dim, self.window = cfg.head_dim, cfg.sliding_window
        self.kernel_queries = KERNEL_QUERIES  # (first, last) prompt chunks the kernel runs

    def linears(self):
        return [(self, "qkv", tuple(f"{self.prefix}{n}_proj" for n in "qkv")),
                (self, "o", (self.prefix + "o_proj",))]  # fmt: skip

    def __call__(self, x, cos, sin, kv, meta: AttentionMetadata, n_heads: int, n_kv: int):
        """x (T, hidden) -> (T, hidden); kv: this layer's (k_cache, v_cache)."""
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv(x)
        for part in self.parts:
            qkv = part(qkv, n_heads, n_kv)
        n_qk = n_heads + n_kv
        qk = apply_rope(qkv[:, : n_qk * d].view(t, n_qk, d), cos, sin)
        q, k = qk[:, :n_heads], qk[:, n_heads:]  # (T, n_heads, d), (T, n_kv, d)
        v = qkv[:, n_qk * d :].view(t, n_kv, d)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.window, self.kernel_queries)
        return self.o(o.reshape(t, n_heads * d))


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
        gate_up = self.gate_up(x)
        ext = eager_kernels(gate_up)
        if ext is not None and gate_up.dim() == 2 and gate_up.shape[1] % 32 == 0:
            return self.down(ext.swiglu(gate_up))  # one pass: silu(gate) * up, as below
        gate, up = gate_up.chunk(2, -1)
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
        if self.shared is not None and self.shared_gate is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        elif self.shared is not None:  # DeepSeek's: always on, ungated
            out = out + self.shared(x)
        return out


class GroupedTopK(MoE):
    """DeepSeek's routed experts, as `MoE` but routed so: `scoring` "softmax" (V2) or "sigmoid"
    (V3, with `bias` (e_score_correction_bias) added for the choice only, not the weights), in
    float32. The experts fall in `groups` groups, of which only the `topk_groups` best are
    eligible (a group scores its best expert for softmax, its two best's sum for sigmoid); the k
    largest eligible are chosen, their scores renormalised when `norm_topk`, times `scaling`
    (routed_scaling_factor). The shared expert (if any) is added ungated."""

    def __init__(self, experts, router, top_k: int, norm_topk: bool, shared, *, scoring: str,
                 bias, groups: int, topk_groups: int, scaling: float):  # fmt: skip
        super().__init__(experts, router, top_k, norm_topk, shared)
        self.scoring, self.bias, self.scaling = scoring, bias, scaling
        self.groups, self.topk_groups = groups, topk_groups

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.router.float())  # (T, E)
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(-1)
        choice = scores if self.bias is None else scores + self.bias.float()
        if self.groups > 1:
            by_group = choice.view(len(x), self.groups, -1)  # (T, groups, E / groups)
            if self.scoring == "sigmoid":
                group_scores = by_group.topk(2, -1).values.sum(-1)
            else:
                group_scores = by_group.amax(-1)
            best = group_scores.topk(self.topk_groups, -1).indices  # (T, topk_groups)
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(by_group.shape[2], 1), -torch.inf)
        ids = choice.topk(self.top_k, -1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids
