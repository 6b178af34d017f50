"""DeepSeek-V2 and V3: multi-head latent attention (`model/mla.py`) in every layer, a dense
SwiGLU MLP in the first `first_k_dense_replace` layers and DeepSeek's experts after them
(`parts.GroupedTopK`: routed experts plus always-on shared ones; V2 scores with a softmax, its
`topk_method` "greedy" or "group_limited_greedy"; V3 with a sigmoid and e_score_correction_bias,
always over groups). Hugging Face folders only (no GGUF names are registered for them)."""

from __future__ import annotations

from pdserve.model.families.dense import Llama
from pdserve.model.mla import MLA
from pdserve.model.parts import GroupedTopK, SwiGLU


def _mla_fields(raw: dict) -> dict:
    """ModelConfig's MLA fields; `head_dim` is the RoPE part's width (as transformers sets it:
    DeepSeek's own config.json has no head_dim)."""
    return {
        "kv_lora_rank": int(raw["kv_lora_rank"]),
        "q_lora_rank": int(raw.get("q_lora_rank") or 0),
        "qk_nope_head_dim": int(raw["qk_nope_head_dim"]),
        "v_head_dim": int(raw["v_head_dim"]),
        "head_dim_override": int(raw["qk_rope_head_dim"]),
    }


def _moe_fields(raw: dict) -> dict:
    """The experts of layers first_k_dense_replace.. (every layer dense without experts)."""
    n, routed = int(raw["num_hidden_layers"]), int(raw.get("n_routed_experts") or 0)
    first_moe = min(int(raw.get("first_k_dense_replace") or 0), n) if routed else n
    if first_moe == n:
        return {"dense_layers": tuple(range(n))}
    width = int(raw["moe_intermediate_size"])
    return {
        "dense_layers": tuple(range(first_moe)),
        "num_experts": routed,
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": width * int(raw.get("n_shared_experts") or 0),
        "routed_scaling_factor": float(raw.get("routed_scaling_factor") or 1.0),
    }


def _groups(raw: dict) -> dict:
    groups, topk = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    if int(raw.get("n_routed_experts") or 0) % groups:
        raise ValueError(
            f"n_group {groups} does not divide n_routed_experts {raw['n_routed_experts']}; "
            "fix config.json (DeepSeek's checkpoints divide them)"
        )
    return {"expert_groups": groups, "topk_groups": topk}


class DeepseekV2(Llama):
    name = "deepseek_v2"
    gguf_permuted_qk = False

    def hf_fields(self, raw: dict) -> dict:
        method = raw.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"DeepSeek-V2 topk_method {method!r} is not supported; use greedy or "
                "group_limited_greedy (as transformers' DeepseekV2)"
            )
        grouped = _groups(raw) if method == "group_limited_greedy" else {}
        # V2's RoPE rotates adjacent pairs of dimensions (a complex multiplication); its top-k
        # weights are not renormalised (transformers' DeepseekV2 ignores norm_topk_prob)
        return _mla_fields(raw) | _moe_fields(raw) | grouped | {
            "rope_interleave": True, "norm_topk_prob": False, "router_scoring": "softmax"
        }  # fmt: skip

    def attention(self, cfg, w, p):
        return MLA(cfg, w, p, cfg.rope_interleave)

    def mlp(self, cfg, w, p, i):
        if i in cfg.dense_layers:
            return SwiGLU(w, p + "mlp.")
        m = p + "mlp."
        experts = [  # None: another rank's expert (expert parallelism, engine/tp/shard.py)
            SwiGLU(w, f"{m}experts.{e}.") if f"{m}experts.{e}.gate_proj.weight" in w else None
            for e in range(cfg.num_experts)
        ]
        shared = SwiGLU(w, m + "shared_experts.") if cfg.shared_expert_intermediate_size else None
        return GroupedTopK(
            experts, w[m + "gate.weight"], cfg.num_experts_per_tok, cfg.norm_topk_prob, shared,
            scoring=cfg.router_scoring, bias=w.get(m + "gate.e_score_correction_bias"),
            groups=cfg.expert_groups, topk_groups=cfg.topk_groups,
            scaling=cfg.routed_scaling_factor,
        )  # fmt: skip

    def eager_reason(self, cfg, layers):
        return "the fused step has no multi-head latent attention"


class DeepseekV3(DeepseekV2):
    name = "deepseek_v3"

    def hf_fields(self, raw: dict) -> dict:
        # rope_interleave (default true): pairs, as V2; false: rotate-half halves, as Llama.
        # V3 routes with sigmoid scores over groups always (its topk_method "noaux_tc"),
        # renormalising as norm_topk_prob says.
        return _mla_fields(raw) | _moe_fields(raw) | _groups(raw) | {
            "rope_interleave": bool(raw.get("rope_interleave", True)),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", True)), "router_scoring": "sigmoid",
        }  # fmt: skip
