"""The fused decode step: `csrc/decode.cpp`, built and loaded by `model/extension.py`.

A decode-only step (one new token per sequence, no KV hooks) runs as one C++ call: every
layer's norms, attention parts (`FUSED_PARTS`: q/k/v biases, per-head q/k RMSNorm), RoPE, cache
write, paged attention over the block table (no gather; over the sliding window where the
config sets one), SwiGLU and residuals fused, the linears as model/quant.py runs them (the
few-row int4/int8 kernels of csrc/few_rows.h, or torch's). So do bf16 prompt chunks (`prompt`
below; model_runner.py `ModelRunner.fused_prompt_rows`: a prompt's run of rows then attends by
the prompt attention kernel), alone or in a call of their own beside a step's decodes; steps
with KV hooks and prompt logprobs stay on the eager model. `--enforce-eager` turns this off;
a machine without a working compiler falls back to eager with a warning that says so.
"""

from __future__ import annotations

import logging

import torch

from pdserve.model import extension, quant
from pdserve.model.parts import HeadQKNorm, QKVBias

log = logging.getLogger(__name__)
# The attention parts the step applies, in the order it applies them (after the qkv linear,
# before RoPE); a layer may have any of them, in this order.
FUSED_PARTS = (QKVBias, HeadQKNorm)


def unfused_parts(parts: list) -> str | None:
    """Why the fused step cannot apply a layer's attention parts (None: it can)."""
    kinds = [type(part) for part in parts]
    if missing := sorted({k.__name__ for k in kinds if k not in FUSED_PARTS}):
        return f"the fused step has no {', '.join(missing)}"
    if kinds != [k for k in FUSED_PARTS if k in kinds]:
        return f"the fused step applies {', '.join(k.__name__ for k in FUSED_PARTS)} in order"
    return None


class FusedDecode:
    """One C++ object holding the model's weights and KV caches (no copies: the same tensors)."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        ext = extension.load_extension()
        self.load_note = extension.load_note  # how long this process took to build or load it

        def linear(lin):  # its dense GEMM as row parts where the eager model's runs so
            split = list(getattr(lin, "split_rows", ()))
            return ext.Linear(*lin.kernel_spec(), split, list(quant.SPLIT_LADDER))

        def parts(layer):  # those of FUSED_PARTS it has (`unfused_parts` checked the rest)
            got = {type(part): part for part in layer.attn.parts}
            bias, norm = got.get(QKVBias), got.get(HeadQKNorm)
            return ext.AttnParts(
                bias.bias if bias else None,
                norm.q if norm else None,
                norm.k if norm else None,
                norm.eps if norm else 0.0,
            )

        cfg = model.cfg
        self.impl = ext.DecodeModel(
            model.embed,
            model.cos,
            model.sin,
            [[layer.attn_norm, layer.mlp_norm] for layer in model.layers],
            [
                [
                    linear(x)
                    for x in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down)
                ]
                for layer in model.layers
            ],
            [parts(layer) for layer in model.layers],
            model.norm,
            linear(model.lm_head),
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.rms_norm_eps,
            cfg.sliding_window,
        )

    def __call__(self, ids, positions, slots, tables, lens, keep=None, prompt=False):
        """Logits (B, V) float32 of one decode token per sequence: ids, positions, slots and
        lens (B,) long; tables (B, W) long block ids, padded (lens bound what is read). `keep`
        (long): only these rows' logits (with `prompt`, only they go past the last layer's
        attention: the other rows' K/V is all the step needs of them). `prompt`: the rows are
        prompt tokens, which keep bf16 values in the layers (model/quant.py `prompt_rows`):
        their quantized linears run only their AMX kernel (bf16 rows), else int8 activations
        where the model has them, else the dense weight; the lm_head as for any row; a run of
        32 rows or more of one sequence attends by the prompt attention kernel where
        `prompt_runs`."""
        return self.impl.forward(ids, positions, slots, tables, lens, keep, prompt)

    @property
    def prompt_runs(self) -> bool:
        """Whether a prompt's run of rows attends by the prompt attention kernel here (a bf16
        cache, no sliding window, head_dim 32 / 64 / 128, a build with AVX512-BF16); else its
        rows go one by one through the decode attention."""
        return self.impl.prompt_runs()


if __name__ == "__main__":  # `python -m pdserve.model.fused`: build now (make install does)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    extension.load_extension()
