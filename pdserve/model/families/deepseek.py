"""DeepSeek-V2 and V3: multi-head latent attention (`model/mla.py`) in every layer, a dense
SwiGLU MLP in the first `first_k_dense_replace` layers and DeepSeek's experts after them.
Hugging Face folders only (no GGUF names are registered for them)."""

from __future__ import annotations

from pdserve.model.families.dense import Llama
from pdserve.model.mla import MLA
from pdserve.model.parts import SwiGLU


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


def _dense_layers(raw: dict) -> tuple[int, ...]:
    n = int(raw["num_hidden_layers"])
    routed = int(raw.get("n_routed_experts") or 0)
    first_moe = min(int(raw.get("first_k_dense_replace") or 0), n) if routed else n
    if first_moe < n:
        raise ValueError(
            f"{raw.get('architectures', ['DeepSeek'])[0]} with Mixture-of-Experts layers "
            f"(layers {first_moe}..{n - 1}: first_k_dense_replace {first_moe} < "
            f"num_hidden_layers {n}) is not supported yet; only dense DeepSeek layers are"
        )
    return tuple(range(n))


class DeepseekV2(Llama):
    name = "deepseek_v2"
    gguf_permuted_qk = False

    def hf_fields(self, raw: dict) -> dict:
        # V2's RoPE rotates adjacent pairs of dimensions (a complex multiplication)
        return _mla_fields(raw) | {"dense_layers": _dense_layers(raw), "rope_interleave": True}

    def attention(self, cfg, w, p):
        return MLA(cfg, w, p, cfg.rope_interleave)

    def mlp(self, cfg, w, p, i):
        return SwiGLU(w, p + "mlp.")

    def eager_reason(self, cfg, layers):
        return "the fused step has no multi-head latent attention"

    def tp_refusal(self, cfg):
        return "multi-head latent attention is not split over ranks yet"


class DeepseekV3(DeepseekV2):
    name = "deepseek_v3"

    def hf_fields(self, raw: dict) -> dict:
        # rope_interleave (default true): pairs, as V2; false: rotate-half halves, as Llama
        return super().hf_fields(raw) | {"rope_interleave": bool(raw.get("rope_interleave", True))}
