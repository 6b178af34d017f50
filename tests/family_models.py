"""Tiny random-weight checkpoints of every served family, built with transformers' own classes
and saved as HF folders (2 layers, hidden 64, vocab 256): the tests compare pdserve with
transformers on the same weights."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, head_dim=16,
            eos_token_id=None, bos_token_id=1, pad_token_id=0)  # fmt: skip
WINDOW = 8  # Mistral's sliding window: the prompts run past it
EXPERTS = dict(num_experts=4, num_experts_per_tok=2)
# multi-head latent attention: the cached latent is 32 + 8 values per token and layer
# (head_dim: transformers' DeepSeek classes take it as the RoPE part's width). Layer 0 dense,
# layer 1 DeepSeek's experts: 4 routed in 2 groups (1 eligible), top-2, one shared expert.
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
           num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=4,
           num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
           routed_scaling_factor=2.5, n_group=2, topk_group=1)  # fmt: skip
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            mscale=1.0, mscale_all_dim=0.8)  # fmt: skip
# family: (config class, model class, the family's own fields)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(EXPERTS, moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(EXPERTS, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       mlp_only_layers=[1])),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(EXPERTS)),
    # V2 with a full-rank q_proj, interleaved RoPE and softmax routing limited to the best group;
    # V3 with a low-rank query, rotate-half RoPE, YaRN (mscale on cos and sin, mscale_all_dim
    # on the softmax scale) and sigmoid routing with e_score_correction_bias
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(MLA, q_lora_rank=None, topk_method="group_limited_greedy")),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(MLA, q_lora_rank=16, rope_interleave=False, rope_parameters=YARN)),
}  # fmt: skip


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: with two threads on a loaded 2-core machine each waits ms on the other
    (measured: 4 us per 3 x 64 x 96 linear on one thread, 2.8 ms on two)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build(family: str, folder: Path, seed: int = 0, **fields):
    """The HF model of `family` with random weights (biases and norms too: transformers
    initialises them to 0 and 1, which would hide a missing one), saved in `folder`; `fields`
    override BASE's (e.g. a real tokenizer's vocab_size)."""
    import torch
    import transformers

    config_cls, model_cls, own = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**BASE, **own, **fields})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "bias" in name:
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias is a buffer
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    model.save_pretrained(str(folder))
    return model


# family -> general.architecture, as llama.cpp's convert_hf_to_gguf.py writes it
GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "llama", "qwen3_moe": "qwen3moe",
             "qwen2_moe": "qwen2moe", "olmoe": "olmoe"}  # fmt: skip
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


def _permute(w, n_head: int):
    """llama.cpp's `LlamaModel.permute`: rotate-half q/k rows -> adjacent-pair rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(family: str, config, weights: dict, path: Path, qtype: str = "F32") -> None:
    """What llama.cpp's convert_hf_to_gguf.py writes for this HF checkpoint (`config`: its
    transformers config; `weights`: its saved tensors, HF-named), in float32, with the `gguf`
    package's writer: the base metadata keys its TextModel writes (the expert count and top-k,
    the Qwen-MoE expert widths), the tensor names of gguf's own name map, every layer's experts
    stacked into one (experts, rows, cols) tensor per projection, and for `llama` (Mixtral) the
    q/k rows permuted. `qtype` (e.g. Q4_0) quantizes the layers' linear weights (as
    llama-quantize does; norms, biases, embeddings and the router stay float32)."""
    import gguf
    import numpy as np

    arch = GGUF_ARCH[family]
    c = config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    if experts := getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None):
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if family in ("qwen2_moe", "qwen3_moe"):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if family == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(by_name[arch], c.num_hidden_layers)
    # Qwen2-MoE's dense layers (mlp_only_layers): llama.cpp's qwen2moe has no such tensors (its
    # converter stops there); written under llama's names, blk.N.ffn_gate etc, pdserve reads them
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    tensors, stacks = {}, {}
    for name, t in weights.items():
        t = np.asarray(t, dtype=np.float32)
        if arch == "llama" and ".q_proj." in name:
            t = _permute(t, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = _permute(t, c.num_key_value_heads)
        if m := _EXPERT.fullmatch(name):
            i, block, e, proj = m.groups()
            merged = f"layers.{i}.feed_forward.experts.{proj}" if block != "mlp" else (
                f"model.layers.{i}.mlp.experts.{proj}"
            )  # fmt: skip
            stacks.setdefault(merged, {})[int(e)] = t
        else:
            suffixes = (".weight", ".bias")
            gname = names.get_name(name, suffixes) or dense.get_name(name, suffixes)
            tensors[gname] = t
    for merged, by_expert in stacks.items():
        tensors[names.get_name(merged) + ".weight"] = np.stack(
            [by_expert[e] for e in sorted(by_expert)]
        )
    quantized = gguf.GGMLQuantizationType[qtype]
    for gname, t in tensors.items():
        if (
            qtype != "F32"
            and gname.startswith("blk.")
            and t.ndim >= 2
            and "ffn_gate_inp" not in gname
        ):
            w.add_tensor(gname, gguf.quants.quantize(t, quantized), raw_dtype=quantized)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build_each(families, tmp_path_factory) -> dict:
    """family -> (HF model, pdserve's ModelFiles of its saved folder), each in a new folder."""
    from pdserve.model.loader import load_model_files

    out = {}
    for family in families:
        folder = tmp_path_factory.mktemp(family)
        out[family] = build(family, folder), load_model_files(str(folder))
    return out
