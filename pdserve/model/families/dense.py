"""Dense families: Llama (the base every family extends), Mistral (sliding-window attention),
Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm)."""

from __future__ import annotations

import torch

from pdserve.model.fused import unfused_parts
from pdserve.model.parts import GQA, HeadQKNorm, QKVBias, SwiGLU


class Llama:
    """The shared decoder's defaults: plain attention (q/k/v biases where the checkpoint has
    them, as Llama's `attention_bias`), a SwiGLU MLP; the fused decode step and tensor
    parallelism serve it and every dense family below."""

    name = "llama"
    gguf_permuted_qk = True  # llama.cpp's converter permutes q/k rows for this family only
    gguf_layer_names: dict[str, str] = {}  # GGUF tensor kinds beyond the shared ones -> HF

    def hf_fields(self, raw: dict) -> dict:
        """ModelConfig fields of this family beyond the shared ones, from config.json."""
        return {}

    def gguf_fields(self, key, shapes: dict[str, tuple[int, ...]], where: str) -> dict:
        """The same fields from GGUF: `key(name, default)` reads `{arch}.name`, `shapes` maps
        each tensor's GGUF name to its shape (HF order). llama.cpp writes no sliding window for
        `llama` (Mistral's GGUF files attend to every position, in llama.cpp as here)."""
        return {}

    def attention(self, cfg, w: dict[str, torch.Tensor], p: str):
        """Layer `p`'s attention part: GQA with this family's parts on its q/k/v projection."""
        return GQA(cfg, w, p, self.attention_parts(cfg, w, p))

    def attention_parts(self, cfg, w: dict[str, torch.Tensor], p: str) -> list:
        if p + "self_attn.o_proj.bias" in w:
            raise ValueError(
                f"{self.name} with a bias on o_proj (config.json attention_bias) is not "
                "supported: pdserve serves q/k/v biases only"
            )
        return [QKVBias(w, p)] if p + "self_attn.q_proj.bias" in w else []

    def mlp(self, cfg, w: dict[str, torch.Tensor], p: str, i: int):
        return SwiGLU(w, p + "mlp.")

    def eager_reason(self, cfg, layers) -> str | None:
        """Why the fused C++ decode step (one SwiGLU per layer; q/k/v biases, per-head q/k
        RMSNorm, full or sliding-window attention) cannot serve this model built as `layers`
        (None: it can)."""
        return next(filter(None, (unfused_parts(layer.attn.parts) for layer in layers)), None)

    def tp_refusal(self, cfg) -> str | None:
        """Why this model cannot run tensor-parallel (None: it can)."""
        return None


class Mistral(Llama):
    """Llama layers with sliding-window attention where config.json sets `sliding_window`:
    every position attends to the last `sliding_window` positions (itself included). The KV
    cache keeps every block; attention masks what lies behind the window, so prefix-cache hits
    and chunked prefill past the window compute what a cold run does."""

    name = "mistral"
    gguf_permuted_qk = False

    def hf_fields(self, raw: dict) -> dict:
        return {"sliding_window": raw.get("sliding_window")}


def _refuse_layered_windows(raw: dict, name: str) -> None:
    if raw.get("use_sliding_window"):
        raise ValueError(
            f"{name} with use_sliding_window (windows on some layers only, max_window_layers) "
            "is not supported; set use_sliding_window false in config.json (its checkpoints "
            "are trained without it)"
        )


class Qwen2(Llama):
    """Llama layers with biases on q, k and v."""

    name = "qwen2"
    gguf_permuted_qk = False

    def hf_fields(self, raw: dict) -> dict:
        _refuse_layered_windows(raw, self.name)
        return {}

    def attention_parts(self, cfg, w, p):
        return [QKVBias(w, p)]


class Qwen3(Qwen2):
    """Llama layers with an RMSNorm over each q and k head (before RoPE)."""

    name = "qwen3"

    def attention_parts(self, cfg, w, p):
        return [*super(Qwen2, self).attention_parts(cfg, w, p), HeadQKNorm(w, p, cfg.rms_norm_eps)]
