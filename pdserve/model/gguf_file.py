"""Read a GGUF file: metadata -> ModelConfig, tensors -> HF-named float32 arrays. The family
comes from `general.architecture` through `model/registry.py` (llama, qwen2, qwen3, qwen2moe,
qwen3moe, olmoe; `llama` with `llama.expert_count` is Mixtral, as llama.cpp writes it); its
metadata keys are prefixed with that name. A family's own fields and tensor names beyond the
shared ones come from the family (`gguf_fields`, `gguf_layer_names`): llama.cpp stacks each
layer's experts into one 3-D tensor per projection (`blk.N.ffn_gate_exps`: experts x rows x
cols), split here into the HF per-expert names.

llama.cpp's converter permutes the rows of Llama's q/k projections so that RoPE rotates adjacent
pairs (not Qwen's: their GGUF RoPE is rotate-half, "neox"); we undo that permutation so one
model implementation (HF's rotate-half RoPE) serves GGUF and safetensors weights alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from pdserve.config import ModelConfig

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0")


class Int4Blocks(NamedTuple):
    """A weight (N, K) as int4 groups: q (N, K) uint8 in [0, 16), scale and zero (N, K // 32)
    float32, w = (q - 8) * scale + zero: a Q4_0 / Q4_1 tensor as the file stores it, which
    model/quant.py packs for its kernels. Here, not there, so that reading a file's config and
    tokenizer (the router) never imports torch."""

    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray

    @staticmethod
    def concat(parts: list[Int4Blocks]) -> Int4Blocks:
        """Row-wise concatenation (fused qkv, gate_up)."""
        return Int4Blocks(*(np.concatenate(col) for col in zip(*parts, strict=True)))


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _reader(path: Path):
    import gguf

    return gguf.GGUFReader(str(path))


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def read_config(path: Path) -> ModelConfig:
    """ModelConfig from GGUF metadata. Raises ValueError for architectures not served."""
    from pdserve.model import registry

    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    experts = bool(_field(reader, f"{arch}.expert_count", 0))
    family = registry.family_for_gguf(arch, experts, str(path))

    def key(name: str, default=None):
        return _field(reader, f"{arch}.{name}", default)

    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    names = set(shapes)
    vocab = key("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    key_len = key("attention.key_length")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        num_layers=int(key("block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        intermediate_size=int(key("feed_forward_length")),
        vocab_size=int(vocab),
        max_position_embeddings=int(key("context_length", 2048)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=None,  # llama3 scaling in GGUF arrives as the rope_freqs tensor
        tie_word_embeddings="output.weight" not in names,
        head_dim_override=int(key_len) if key_len and int(key_len) != hidden // heads else None,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        architecture=family,
        **registry.family(family).gguf_fields(key, shapes, str(path)),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (adjacent-pair RoPE -> rotate-half RoPE)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str, fam) -> str | None:
    """The HF name of GGUF tensor `name`; one holding a layer's stacked experts gives a name
    with `{e}` where the expert's index goes."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")  # blk.{i}.{kind}.weight (or .bias)
    if parts[0] == "blk" and len(parts) == 4:
        kind = _LAYER_NAMES.get(parts[2]) or fam.gguf_layer_names.get(parts[2])
        if kind is not None:
            return f"model.layers.{parts[1]}.{kind}.{parts[3]}"
    if name == "rope_freqs.weight":
        return "rope_freqs"
    return None


def _split(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """{HF name: array}: one, or one per expert of a stacked (experts, ...) tensor."""
    return {name.format(e=e): w[e] for e in range(w.shape[0])} if "{e}" in name else {name: w}


def _heads(name: str, config: ModelConfig) -> int | None:
    """How many heads a q/k projection's rows (weight or bias) hold; None for other tensors."""
    if ".q_proj." in name:
        return config.num_heads
    return config.num_kv_heads if ".k_proj." in name else None


def read_tensors(path: Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 and renamed to Hugging Face's names."""
    import gguf

    from pdserve.model import registry

    fam = registry.family(config.architecture)
    reader = _reader(path)
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, fam)
        if name is None:
            continue
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_TYPES:
            raise ValueError(
                f"{path}: tensor {t.name} has type {qtype}; supported: {', '.join(SUPPORTED_TYPES)}"
            )
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        n_head = _heads(name, config)
        if n_head is not None and fam.gguf_permuted_qk:
            w = _unpermute(w, n_head)
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # llama.cpp reads it as one vector (n_embd)
        out.update(_split(name, w))
    return out


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(rows, blocks, 16) packed bytes -> (rows, blocks * 32) values in [0, 16): a block's low
    nibbles are its elements 0-15, its high nibbles 16-31 (ggml's layout)."""
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (rows, blocks, 32)
    return q.reshape(qs.shape[0], -1)


def _int4_blocks(data: np.ndarray, qtype: str, rows: int) -> Int4Blocks:
    """A Q4_0 / Q4_1 tensor's raw bytes (rows, bytes per row) as Int4Blocks, unexpanded."""
    head = 4 if qtype == "Q4_1" else 2  # fp16 d (and fp16 m for Q4_1) before 16 bytes of nibbles
    blocks = data.reshape(rows, -1, head + 16)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # (rows, blocks)
    if qtype == "Q4_1":  # w = d * q + m = d * (q - 8) + (m + 8 d)
        zero = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d
    else:  # Q4_0: w = d * (q - 8)
        zero = np.zeros_like(d)
    return Int4Blocks(_nibbles(blocks[..., head:]), d, zero)


def read_int4_blocks(path: Path, config: ModelConfig) -> dict[str, Int4Blocks]:
    """The linear weights stored as Q4_0 / Q4_1, in HF naming, as their own 4-bit blocks (q/k
    rows un-permuted like `read_tensors`, stacked experts split); other tensors are left out."""
    from pdserve.model import registry

    fam = registry.family(config.architecture)
    out: dict[str, Int4Blocks] = {}
    for t in _reader(path).tensors:
        name = _hf_name(t.name, fam)
        if name is None or t.tensor_type.name not in ("Q4_0", "Q4_1") or "layers" not in name:
            continue
        stack = int(t.shape[2]) if len(t.shape) == 3 else 1  # experts
        rows = int(t.shape[1])
        b = _int4_blocks(np.asarray(t.data).reshape(stack * rows, -1), t.tensor_type.name,
                         stack * rows)  # fmt: skip
        n_head = _heads(name, config)
        if n_head is not None and fam.gguf_permuted_qk:
            b = Int4Blocks(*(_unpermute(a, n_head) for a in b))
        if "{e}" in name:
            for e in range(stack):
                out[name.format(e=e)] = Int4Blocks(*(a[e * rows : (e + 1) * rows] for a in b))
        else:
            out[name] = b
    return out
