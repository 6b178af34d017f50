"""Model shapes for the planner: presets for well-known models, and loading a HF `config.json`.

Only what the KV and latency math needs is kept: layer count, widths, attention heads (query and
KV, so GQA and MQA come out right), MLA's compressed latent for DeepSeek-V3, parameter counts
(total, and active per token for mixture-of-experts models) and the vocabulary.

A little over 300 lines: some 80 of them are the `PRESETS` table, data rather than code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer.

    `num_params` is every weight (what must fit in memory); `active_params` is what one token
    multiplies through (smaller for mixture-of-experts). For MLA models (`kv_lora_rank` set) the
    KV cache holds one compressed latent of `kv_lora_rank` plus a shared RoPE key of
    `qk_rope_head_dim` per token and layer, instead of per-head K and V.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    active_params: int | None = None
    tie_embeddings: bool = False
    num_experts: int = 1
    experts_per_token: int = 1
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k (2 x head_dim weights)

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"model {self.name!r}: {field} must be >= 1")
        for field in ("intermediate_size", "vocab_size", "num_params"):
            if getattr(self, field) < 1:
                raise ValueError(f"model {self.name!r}: {field} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError(
                f"model {self.name!r}: MLA needs both kv_lora_rank and qk_rope_head_dim"
            )
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"model {self.name!r}: need 1 <= experts_per_token <= num_experts")
        if self.active_params is not None and not 0 < self.active_params <= self.num_params:
            raise ValueError(f"model {self.name!r}: need 0 < active_params <= num_params")

    @property
    def attention(self) -> str:
        """ "MLA", "MQA" (one KV head), "GQA" (fewer KV than query heads) or "MHA"."""
        if self.kv_lora_rank is not None:
            return "MLA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA" if self.num_kv_heads < self.num_heads else "MHA"

    @property
    def params_per_token(self) -> int:
        """Parameters one token passes through (all of them for a dense model)."""
        return self.active_params or self.num_params

    @property
    def embedding_params(self) -> int:
        """Input embedding plus, when untied, the output head (both vocab x hidden)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @property
    def layer_params_per_token(self) -> int:
        """Transformer-layer weights one token multiplies through (embeddings excluded)."""
        return self.params_per_token - self.embedding_params

    @property
    def expert_params(self) -> int:
        """Weights in routed experts (0 for dense), from total vs active counts."""
        if self.num_experts == 1 or self.active_params is None:
            return 0
        routed_share = 1.0 - self.experts_per_token / self.num_experts
        return int((self.num_params - self.active_params) / routed_share)


def estimate_params(
    spec: ModelSpec, expert_ffn: int | None = None, ffn_matrices: int = 3, shared_ffn: int = 0
) -> tuple[int, int]:
    """(total, active) weights of a block stack: attention, FFN, embeddings.

    `ffn_matrices` is 3 for gated FFNs (Llama's SwiGLU), 2 for plain ones (OPT, Falcon). Exact
    for the Llama-style presets (two norms per layer and a final one), Qwen3's q/k norms and a
    MoE's router (hidden x experts per layer) and shared expert (`shared_ffn` wide, with its
    gate; Qwen2-MoE); biases are ignored. A MoE's total counts every expert (what must be in
    memory), its active count the top-k a token passes through (its FLOPs).
    """
    h, d = spec.hidden_size, spec.head_dim
    attn = h * d * (2 * spec.num_heads + 2 * spec.num_kv_heads) + 2 * h
    attn += 2 * d if spec.qk_norm else 0
    ffn_width = expert_ffn or spec.intermediate_size
    expert = ffn_matrices * h * ffn_width
    if spec.num_experts > 1:
        attn += h * spec.num_experts  # the router
        attn += (ffn_matrices * h * shared_ffn + h) if shared_ffn else 0
    total_layer = attn + expert * spec.num_experts
    active_layer = attn + expert * spec.experts_per_token
    emb = spec.embedding_params + h
    return spec.num_layers * total_layer + emb, spec.num_layers * active_layer + emb


def _replace_params(spec: ModelSpec, total: int, active: int | None) -> ModelSpec:
    return replace(spec, num_params=total, active_params=active)


def _llama(name, layers, hidden, heads, kv, ffn, vocab, params, head_dim=128, tie=False):
    return ModelSpec(name, layers, hidden, heads, kv, head_dim, ffn, vocab, params, None, tie)


def _qwen3(name, layers, hidden, heads, kv, ffn, experts=1, per_token=1, expert_ffn=None):
    """A Qwen3 dense or MoE shape (head_dim 128 whatever hidden / heads is, untied embeddings,
    q/k norms); parameter counts from the shapes, which match the model cards' 8.19B, 32.8B and
    235B total / 22B active."""
    spec = ModelSpec(name, layers, hidden, heads, kv, 128, ffn, 151936, 1, None, False,
                     experts, per_token, qk_norm=True)  # fmt: skip
    total, active = estimate_params(spec, expert_ffn)
    return _replace_params(spec, total, active if experts > 1 else None)


# Shapes from each model's published config.json; parameter counts from its model card.
PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8_030_261_248),
        _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 70_553_706_496),
        _llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 8_030_261_248),
        _llama("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, 70_553_706_496),
        _llama("llama-3.1-405b", 126, 16384, 128, 8, 53248, 128256, 405_853_388_800),
        _llama("llama-3.3-70b", 80, 8192, 64, 8, 28672, 128256, 70_553_706_496),
        _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 6_738_415_616),
        _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 13_015_864_320),
        _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 68_976_648_192),
        _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32768, 7_248_023_552),
        ModelSpec(
            "mixtral-8x7b",
            32,
            4096,
            32,
            8,
            128,
            14336,
            32000,
            46_702_792_704,
            active_params=12_879_921_152,
            num_experts=8,
            experts_per_token=2,
        ),
        ModelSpec(
            "mixtral-8x22b",
            56,
            6144,
            48,
            8,
            128,
            16384,
            32768,
            140_620_634_112,
            active_params=39_158_374_400,
            num_experts=8,
            experts_per_token=2,
        ),
        _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 7_615_616_512),
        _llama("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, 32_763_876_352),
        _llama("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, 72_706_203_648),
        # MLA: 128 query heads of 192 dims (128 no-RoPE + 64 RoPE); the cache keeps a
        # 512-wide latent plus the 64-wide RoPE key per token and layer. 256 routed experts,
        # 8 per token (one shared expert counts as dense).
        ModelSpec(
            "deepseek-v3",
            61,
            7168,
            128,
            128,
            192,
            18432,
            129280,
            671_000_000_000,
            active_params=37_000_000_000,
            num_experts=256,
            experts_per_token=8,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
        ),
        # DeepSeek-V2-Lite (its config.json: 27 layers, 16 heads, q not low-rank, 64 routed
        # experts of width 1408, 6 per token, 2 shared; "15.7B total, 2.4B activated"): the
        # same 512 + 64 latent per token and layer, and small enough for one GPU, so the seed's
        # one-node deployments apply to it
        ModelSpec(
            "deepseek-v2-lite",
            27,
            2048,
            16,
            16,
            192,
            10944,
            102400,
            15_700_000_000,
            active_params=2_400_000_000,
            num_experts=64,
            experts_per_token=6,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
        ),
        # Kimi-K2 (Moonshot's config.json: DeepSeek-V3's architecture with 64 query heads, 384
        # routed experts, 8 per token, a 163,840-token vocabulary; "1T total, 32B activated"):
        # the same 512 + 64 latent per token and layer as DeepSeek-V3
        ModelSpec(
            "kimi-k2",
            61,
            7168,
            64,
            64,
            192,
            18432,
            163840,
            1_000_000_000_000,
            active_params=32_000_000_000,
            num_experts=384,
            experts_per_token=8,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
        ),
        # Qwen3 (config.json of Qwen/Qwen3-8B, -32B, -235B-A22B): 32B's head_dim is 128 though
        # 5120 / 64 heads is 80; the MoE has 128 experts of width 1536, 8 per token, in every
        # layer, and only 4 KV heads.
        _qwen3("qwen3-8b", 36, 4096, 32, 8, 12288),
        _qwen3("qwen3-32b", 64, 5120, 64, 8, 25600),
        _qwen3("qwen3-235b-a22b", 94, 4096, 64, 4, 12288, 128, 8, 1536),
        _llama("smollm2-135m", 30, 576, 9, 3, 1536, 49152, 134_515_008, head_dim=64, tie=True),
        _llama("smollm2-360m", 32, 960, 15, 5, 2560, 49152, 361_821_120, head_dim=64, tie=True),
        _llama("smollm2-1.7b", 24, 2048, 32, 32, 8192, 49152, 1_711_376_384, 64, tie=True),
        # MQA example: a single KV head shared by all 71 query heads.
        _llama("falcon-7b", 32, 4544, 71, 1, 18176, 65024, 6_921_720_704, head_dim=64, tie=True),
        _llama("opt-13b", 40, 5120, 40, 40, 20480, 50272, 12_853_473_280, tie=True),
        _llama("opt-66b", 64, 9216, 72, 72, 36864, 50272, 65_707_536_384, tie=True),
        _llama("opt-175b", 96, 12288, 96, 96, 49152, 50272, 175_000_000_000, tie=True),
    )
}


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name (case-insensitive), or a model read from a HF `config.json` path.

    Raises ValueError listing the presets when the name is neither.
    """
    key = name_or_path.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        return load_hf_config(path)
    raise ValueError(
        f"unknown model {name_or_path!r}: give a HF config.json path or one of {', '.join(PRESETS)}"
    )


_ALIASES = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_heads": ("num_attention_heads", "n_head"),
    "vocab_size": ("vocab_size",),
}


def _first(cfg: dict, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        if cfg.get(key) is not None:
            return int(cfg[key])
    return None


def load_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face `config.json` (Llama/Mistral/Qwen/Mixtral/OPT/Falcon/DeepSeek style).

    Missing head_dim, KV heads or FFN width fall back to the usual defaults; a missing layer
    count, width, head count or vocabulary raises ValueError naming the field to add. The
    parameter count is estimated from the shapes when the file does not state it.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"model config {str(path)!r} does not exist; give a preset name or path")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"model config {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"model config {str(path)!r} must hold a JSON object")
    dims = {name: _first(cfg, keys) for name, keys in _ALIASES.items()}
    missing = [keys[0] for name, keys in _ALIASES.items() if not dims[name]]
    if missing:
        raise ValueError(f"model config {str(path)!r} lacks {', '.join(missing)}; add it")
    return _spec_from_config(cfg, path, **dims)


def _spec_from_config(cfg: dict, path: Path, **dims: int) -> ModelSpec:
    hidden, heads = dims["hidden_size"], dims["num_heads"]
    kv_heads = _first(cfg, ("num_key_value_heads", "num_kv_heads"))
    if kv_heads is None:
        kv_heads = 1 if cfg.get("multi_query") else heads
    mla_rank = _first(cfg, ("kv_lora_rank",))
    rope_dim = _first(cfg, ("qk_rope_head_dim",)) if mla_rank else None
    if mla_rank:
        head_dim = (_first(cfg, ("qk_nope_head_dim",)) or 128) + (rope_dim or 0)
    else:
        head_dim = _first(cfg, ("head_dim",)) or hidden // heads
    ffn = _first(cfg, ("intermediate_size", "ffn_dim", "n_inner")) or 4 * hidden
    experts = _first(cfg, ("num_local_experts", "n_routed_experts", "num_experts")) or 1
    per_token = _first(cfg, ("num_experts_per_tok",)) or 1
    tie = bool(cfg.get("tie_word_embeddings", cfg.get("model_type") == "opt"))
    spec = ModelSpec(
        name=str(cfg.get("_name_or_path") or path.parent.name or path.stem),
        num_layers=dims["num_layers"], hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=ffn,
        vocab_size=dims["vocab_size"], num_params=1, tie_embeddings=tie,
        num_experts=experts, experts_per_token=min(per_token, experts),
        kv_lora_rank=mla_rank, qk_rope_head_dim=rope_dim,
        qk_norm=cfg.get("model_type") in ("qwen3", "qwen3_moe"),
    )  # fmt: skip
    plain_ffn = cfg.get("model_type") in ("opt", "falcon", "gpt2", "gpt_neox", "gpt_bigcode")
    total, active = estimate_params(
        spec, _first(cfg, ("moe_intermediate_size",)), 2 if plain_ffn else 3,
        _first(cfg, ("shared_expert_intermediate_size",)) or 0,
    )  # fmt: skip
    return _replace_params(spec, total, active if experts > 1 else None)


def from_engine_config(cfg: object, name: str = "engine-model") -> ModelSpec:
    """A ModelSpec from the engine's `llm.model_config` (attributes named as in the engine;
    for MLA, the engine's head_dim is the RoPE part's)."""
    mla = getattr(cfg, "kv_lora_rank", 0)
    spec = ModelSpec(
        name=name,
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.qk_nope_head_dim + cfg.head_dim if mla else cfg.head_dim,
        intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size, num_params=1,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
        kv_lora_rank=mla or None, qk_rope_head_dim=cfg.head_dim if mla else None,
    )  # fmt: skip
    total, _ = estimate_params(spec)
    return _replace_params(spec, total, None)
