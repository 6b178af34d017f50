"""Tiny random-weight checkpoints of every served family, built with transformers' own classes
and saved as HF folders (2 layers, hidden 64, vocab 256): the tests compare pdserve with
transformers on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, head_dim=16,
            eos_token_id=None, bos_token_id=1, pad_token_id=0)  # fmt: skip
WINDOW = 8  # Mistral's sliding window: the prompts run past it
EXPERTS = dict(num_experts=4, num_experts_per_tok=2)
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


def build(family: str, folder: Path, seed: int = 0):
    """The HF model of `family` with random weights (biases and norms too: transformers
    initialises them to 0 and 1, which would hide a missing one), saved in `folder`."""
    import torch
    import transformers

    config_cls, model_cls, own = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**BASE, **own)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "bias" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(str(folder))
    return model


# HF weight name -> GGUF tensor name (llama.cpp's), for the layers' tensors
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_gguf(model, arch: str, path: Path) -> None:
    """The HF `model`'s float32 weights and shape as a GGUF file of `arch` (qwen2 or qwen3:
    rotate-half RoPE, so no q/k permutation), written with the `gguf` package's writer."""
    import gguf

    c = model.config
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
    for name, t in model.state_dict().items():
        if name in _GGUF_GLOBAL:
            gname = _GGUF_GLOBAL[name]
        else:
            _, _, i, *rest = name.split(".")
            gname = f"blk.{i}.{_GGUF_LAYER['.'.join(rest[:-1])]}.{rest[-1]}"
        w.add_tensor(gname, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
