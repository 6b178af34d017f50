"""Frozen configuration: the model's shape and the engine's knobs, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pdserve.model.kv_shape import KVShape, kv_shape

ROLES = ("both", "prefill", "decode")
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_FORMATS = ("auto", "bf16", "int8", "int4")  # see model/quant.py
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype; int8: see model/kv_int8.py
# `pdserve serve --decode-chunk-size`: the token budget per step of a disaggregated decode
# worker's own prefills (`EngineConfig.chunk_size` of its engine); sim's `Deployment.served`
# models the same.
DECODE_CHUNK_SIZE = 64
# A worker's token budget per step (`EngineConfig.chunk_size`) unless `--chunk-size` says (0:
# whole prompts). A prefill worker reads the routers between chunks, so a prompt whose client
# left stops within one (a 4,311-token prompt in chunks is no slower:
# docs/serving.md#prefill-chunks). A co-located worker chunks as vLLM's scheduler does: a step
# holds at most this many tokens, its running streams' included, so under load a waiting
# prompt's first token comes after a bounded step (TTFT figures: docs/results.md). A decode
# worker's is `--decode-chunk-size`; the offline engine (`LLM`) keeps whole prompts.
WORKER_CHUNK_SIZE = {"prefill": 1024, "both": 1024}


ROPE_TYPES = ("default", "llama3", "yarn", "linear")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling from HF `rope_scaling` / `rope_parameters` (`model/rope.py` computes it):
    "llama3" (frequency-dependent, with low/high_freq_factor), "yarn" (beta_fast/slow and an
    attention factor on cos/sin; Qwen's long-context setting) or "linear" (positions / factor)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # yarn: None = from factor (and mscale, mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @staticmethod
    def from_hf(raw: dict | None) -> RopeScaling | None:
        """From config.json's `rope_scaling` (transformers < 5) or `rope_parameters` (>= 5); None
        for plain RoPE. An unknown type is refused by name."""
        if not raw:
            return None
        kind = raw.get("rope_type", raw.get("type", "default"))
        if kind == "default":
            return None
        if kind not in ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )
        keys = {f.name for f in fields(RopeScaling)} - {"rope_type"}
        return RopeScaling(rope_type=kind, **{k: raw[k] for k in keys if raw.get(k) is not None})


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder. Built by the loader from GGUF metadata or config.json; `architecture`
    names its family in `model/registry.py`, which says what the family adds to the shared
    decoder. The Mixture-of-Experts fields are 0 for a dense model."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = True
    head_dim_override: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    sliding_window: int | None = None  # attend to the last this many positions (Mistral)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's MLP width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's, DeepSeek's always-on expert
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP instead
    # DeepSeek's routing (`parts.GroupedTopK`): "softmax" (V2) or "sigmoid" (V3) scores, the
    # experts in expert_groups groups of which topk_groups are eligible, the chosen experts'
    # weights times routed_scaling_factor
    router_scoring: str = "softmax"
    expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-head latent attention (DeepSeek-V2/V3, `model/mla.py`), 0 elsewhere: the cached
    # latent's width, the query's low rank (0: a full-rank q_proj), each head's q/k part
    # without RoPE and its value width. `head_dim` is then the RoPE part's (qk_rope_head_dim).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE over adjacent pairs of dimensions (DeepSeek's)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}); this is not a GQA decoder pdserve can serve"
            )
        if self.head_dim_override is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by {self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_heads

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_shape(self, kv_heads: int | None = None) -> KVShape:
        """What the cache holds per token and layer, for a rank of `kv_heads` KV heads (None:
        all of them): K and V per head, or MLA's latent (every rank holds it whole)."""
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        rope = self.head_dim if self.is_mla else 0
        return kv_shape(heads, self.head_dim, self.kv_lora_rank, rope)


def default_block_size(colocated: bool) -> int:
    """Tokens a KV block where none is given: prefix hits, the KV store and transfers go by
    whole blocks. A co-located engine's KV never crosses a link: 128, as vLLM's CPU backend. A
    decode step reads each sequence's K/V block by block, and a block of 16 tokens (6 KB a layer
    at SmolLM2's 3 KV heads) ends the hardware prefetcher's stream where blocks lie apart, as
    they do once a server has reused them: 64 sequences at ~300 tokens on shuffled blocks (Zen
    4, one process, alternating) 77.3 ms a step at 16, 70.1 at 128. Prefill and decode workers
    (and their router) keep 16: a prompt's KV crosses as whole blocks, and blocks of 128 would
    send up to 127 tokens of padding with each prompt (a 538-token one: 640 tokens' bytes, not
    544)."""
    return 128 if colocated else 16


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine. `chunk_size=None` means whole prompts are prefilled in one step."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    weights: str = "auto"  # auto | bf16 | int8 | int4: see model/quant.py
    int8_activations: str = "off"  # off | on: model/act_quant.py
    enforce_eager: bool = False  # True: no compiled decode step (debugging)
    role: str = "both"
    block_size: int | None = None  # tokens a KV block; None: default_block_size(role)
    kv_cache_gb: float | None = None
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8: model/kv_int8.py
    kv_cache_fraction: float = 0.25
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunk_size: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    tensor_parallel_size: int = 1  # ranks (processes) of this engine: engine/tp/
    # experts split over this many groups of those ranks (Mixture-of-Experts): engine/tp/shard.py
    expert_parallel_size: int = 1
    # stages (processes) of this engine, each holding consecutive layers: engine/pp/
    pipeline_parallel_size: int = 1
    pp_layer_partition: str | None = None  # each stage's layer count, "15,15"; None: even
    # JSON with vLLM's fields, e.g. {"method": "ngram", "num_speculative_tokens": 4}: off if None
    speculative_config: str | None = None  # engine/spec_decode.py

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        ep, tp = self.expert_parallel_size, self.tensor_parallel_size
        if ep < 1 or tp % ep:
            raise ValueError(
                f"--expert-parallel-size {ep} must divide --tensor-parallel-size {tp}: the experts "
                f"are split over the engine's ranks (e.g. --tensor-parallel-size {max(ep, 1)})"
            )
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        self._check_pipeline()
        if self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be auto, bf16, int8 or int4, got {self.weights!r}")
        if self.int8_activations not in ("off", "on"):
            raise ValueError(f"int8_activations must be off or on, got {self.int8_activations!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto or int8, got {self.kv_cache_dtype!r}")
        if self.block_size is None:
            object.__setattr__(self, "block_size", default_block_size(self.role == "both"))
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (or None to disable), got {self.chunk_size}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if not 0 < self.kv_cache_fraction <= 0.9:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.9], got {self.kv_cache_fraction}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")

    def _check_pipeline(self) -> None:
        """What pipeline parallelism refuses before any model loads (the layer count is
        checked against the model when the stages start: `engine/pp/stages.py`)."""
        pp = self.pipeline_parallel_size
        if pp < 1:
            raise ValueError(f"--pipeline-parallel-size must be >= 1, got {pp}")
        if self.pp_layer_partition is not None and pp == 1:
            raise ValueError(
                "--pp-layer-partition splits the layers of a pipeline: add "
                "--pipeline-parallel-size N (N counts, e.g. 15,15 for 2 stages)"
            )
        if pp > 1 and self.role == "decode":
            raise ValueError(
                "pipeline parallelism is for prefill (role prefill, or a co-located engine): a "
                "decode step through a pipeline pays a hop per stage for every token. Give "
                "decode workers --tensor-parallel-size instead"
            )
