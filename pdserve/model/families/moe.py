"""Mixture-of-Experts families: Mixtral (softmax top-2, renormalised), Qwen3-MoE (top-k,
`norm_topk_prob`, per-head q/k norm), Qwen2-MoE (q/k/v biases, a gated shared expert), OLMoE
(q/k norm over all heads). Their experts are `parts.MoE`; the fused decode step serves none.

From GGUF (llama.cpp's names: `llama` with experts, `qwen3moe`, `qwen2moe`, `olmoe`) the expert
count and top-k are `{arch}.expert_count` / `expert_used_count`, each expert's width and the
MoE layers come from the tensors' shapes, and the renormalisation is llama.cpp's per
architecture (its graphs hard-code it: Mixtral and Qwen3-MoE renormalise, Qwen2-MoE and OLMoE
do not; the files carry no `norm_topk_prob`)."""

from __future__ import annotations

from pdserve.model.families.dense import Llama, Qwen2, Qwen3
from pdserve.model.parts import MoE, SwiGLU, WideQKNorm


def _sparse_fields(raw: dict) -> dict:
    """Qwen-MoE's layers: sparse unless in mlp_only_layers or off the decoder_sparse_step."""
    n, step = int(raw["num_hidden_layers"]), int(raw.get("decoder_sparse_step") or 1)
    only = set(raw.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(n) if i in only or (i + 1) % step)
    return {
        "num_experts": _num_experts(raw),
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw["moe_intermediate_size"]),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "dense_layers": dense,
    }


def _num_experts(raw: dict) -> int:
    """Qwen's checkpoints say num_experts; transformers >= 5 saves num_local_experts."""
    n = raw.get("num_experts") or raw.get("num_local_experts")
    if not n:
        raise KeyError("num_experts")
    return int(n)


class _MoEFamily(Llama):
    expert_prefix = "mlp."  # where a layer's router ("gate") and experts live
    expert_names = ("gate_proj", "up_proj", "down_proj")
    gguf_permuted_qk = False
    gguf_norm_topk = False  # what llama.cpp's graph of this architecture does

    @property
    def gguf_layer_names(self) -> dict[str, str]:
        m = self.expert_prefix
        stacked = zip(("gate", "up", "down"), self.expert_names, strict=True)
        return {"ffn_gate_inp": m + "gate"} | {
            f"ffn_{kind}_exps": f"{m}experts.{{e}}.{name}" for kind, name in stacked
        }

    def gguf_fields(self, key, shapes, where):
        def need(name: str) -> int:
            value = key(name)
            if not value:
                raise ValueError(f"{where}: a Mixture-of-Experts GGUF needs {name} (not found)")
            return int(value)

        n = need("block_count")
        routed = {int(name.split(".")[1]) for name in shapes if ".ffn_gate_inp." in name}
        gate = next((s for name, s in shapes.items() if ".ffn_gate_exps." in name), None)
        if gate is None:
            raise ValueError(f"{where}: no stacked expert tensors (blk.N.ffn_gate_exps)")
        return {
            "num_experts": need("expert_count"),
            "num_experts_per_tok": need("expert_used_count"),
            "moe_intermediate_size": gate[1],  # (experts, width, hidden)
            "norm_topk_prob": self.gguf_norm_topk,
            "dense_layers": tuple(i for i in range(n) if i not in routed),
        }

    def mlp(self, cfg, w, p, i):
        if i in cfg.dense_layers:
            return SwiGLU(w, p + "mlp.")
        m = p + self.expert_prefix
        gate = self.expert_names[0]
        experts = [  # None: another rank's expert (expert parallelism, engine/tp/shard.py)
            SwiGLU(w, f"{m}experts.{e}.", self.expert_names)
            if f"{m}experts.{e}.{gate}.weight" in w
            else None
            for e in range(cfg.num_experts)
        ]
        return MoE(experts, w[m + "gate.weight"], cfg.num_experts_per_tok, cfg.norm_topk_prob,
                   *self.shared(cfg, w, m))  # fmt: skip

    def shared(self, cfg, w, m: str) -> tuple:
        return ()

    def eager_reason(self, cfg, layers):
        return "the fused step has no Mixture-of-Experts layers"


class Mixtral(_MoEFamily):
    name = "mixtral"
    expert_prefix = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")
    gguf_permuted_qk = True  # written as llama
    gguf_norm_topk = True

    def hf_fields(self, raw):
        return {
            "num_experts": _num_experts(raw),
            "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["intermediate_size"]),
            "norm_topk_prob": True,
            "sliding_window": raw.get("sliding_window"),
        }


class Qwen3Moe(_MoEFamily):
    name = "qwen3_moe"
    gguf_norm_topk = True

    def hf_fields(self, raw):
        Qwen3().hf_fields(raw)
        return _sparse_fields(raw)

    def attention_parts(self, cfg, w, p):
        return Qwen3().attention_parts(cfg, w, p)


class Qwen2Moe(_MoEFamily):
    name = "qwen2_moe"

    def hf_fields(self, raw):
        Qwen2().hf_fields(raw)
        return _sparse_fields(raw) | {
            "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0)
        }

    def attention_parts(self, cfg, w, p):
        return Qwen2().attention_parts(cfg, w, p) if p + "self_attn.q_proj.bias" in w else []

    @property
    def gguf_layer_names(self):
        return super().gguf_layer_names | {
            "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
            **{f"ffn_{k}_shexp": f"mlp.shared_expert.{k}_proj" for k in ("gate", "up", "down")},
        }

    def gguf_fields(self, key, shapes, where):
        shared = next((s for name, s in shapes.items() if ".ffn_gate_shexp." in name), (0,))
        return super().gguf_fields(key, shapes, where) | {
            "shared_expert_intermediate_size": shared[0]
        }

    def shared(self, cfg, w, m):
        if not cfg.shared_expert_intermediate_size:
            return ()
        return SwiGLU(w, m + "shared_expert."), w[m + "shared_expert_gate.weight"]


class Olmoe(_MoEFamily):
    name = "olmoe"

    def hf_fields(self, raw):
        if raw.get("clip_qkv") is not None:
            raise ValueError("OLMoE with clip_qkv is not supported (set it to null)")
        return {
            "num_experts": _num_experts(raw),
            "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["intermediate_size"]),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        }

    def attention_parts(self, cfg, w, p):
        return [*super().attention_parts(cfg, w, p), WideQKNorm(w, p, cfg.rms_norm_eps)]

    def tp_refusal(self, cfg):
        return "OLMoE's q/k norms span all heads (they would need every rank's heads)"
