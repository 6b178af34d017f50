"""Which model family a checkpoint is, from its own metadata: config.json's `architectures`
(then `model_type`), or GGUF's `general.architecture`. One table maps those names to the module
and class of each family, imported only when chosen; never a file name.

A family (`families/dense.py`, `families/moe.py`, `families/deepseek.py`) says what it adds to
the shared decoder (`llama.py`): its config.json fields, its attention part (GQA with parts on
its q/k/v projection, or multi-head latent attention) and its MLP per layer, whether the fused
C++ decode step and tensor parallelism serve it.
"""

from __future__ import annotations

import importlib

# family: (module:class, HF architectures, GGUF general.architecture names). A GGUF name ending
# "+experts" matches that architecture with `{arch}.expert_count` > 0: llama.cpp writes Mixtral
# as `llama` with expert tensors.
FAMILIES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "llama": ("pdserve.model.families.dense:Llama", ("LlamaForCausalLM",), ("llama",)),
    "mistral": ("pdserve.model.families.dense:Mistral", ("MistralForCausalLM",), ()),
    "qwen2": ("pdserve.model.families.dense:Qwen2", ("Qwen2ForCausalLM",), ("qwen2",)),
    "qwen3": ("pdserve.model.families.dense:Qwen3", ("Qwen3ForCausalLM",), ("qwen3",)),
    "mixtral": ("pdserve.model.families.moe:Mixtral", ("MixtralForCausalLM",), ("llama+experts",)),
    "qwen2_moe": ("pdserve.model.families.moe:Qwen2Moe", ("Qwen2MoeForCausalLM",), ("qwen2moe",)),
    "qwen3_moe": ("pdserve.model.families.moe:Qwen3Moe", ("Qwen3MoeForCausalLM",), ("qwen3moe",)),
    "olmoe": ("pdserve.model.families.moe:Olmoe", ("OlmoeForCausalLM",), ("olmoe",)),
    "deepseek_v2": ("pdserve.model.families.deepseek:DeepseekV2", ("DeepseekV2ForCausalLM",), ()),
    "deepseek_v3": ("pdserve.model.families.deepseek:DeepseekV3", ("DeepseekV3ForCausalLM",), ()),
}
_BY_HF = {arch: fam for fam, (_, archs, _) in FAMILIES.items() for arch in archs}
_BY_GGUF = {arch: fam for fam, (_, _, ggufs) in FAMILIES.items() for arch in ggufs}
_loaded: dict[str, object] = {}


class UnsupportedArchitecture(ValueError):
    """The checkpoint names an architecture no family here serves."""


def supported() -> str:
    return ", ".join(f"{arch} ({fam})" for fam, (_, archs, _) in FAMILIES.items() for arch in archs)


def family(name: str):
    """The family object registered under `name` (a key of FAMILIES), imported on first use."""
    if name not in _loaded:
        module, cls = FAMILIES[name][0].split(":")
        _loaded[name] = getattr(importlib.import_module(module), cls)()
    return _loaded[name]


def family_for_hf(raw: dict, where: str) -> str:
    """The family of a config.json: its first known `architectures` entry, else `model_type`."""
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in _BY_HF:
            return _BY_HF[arch]
    if not archs and raw.get("model_type") in FAMILIES:
        return raw["model_type"]
    named = ", ".join(archs) or f"model_type {raw.get('model_type')!r}"
    raise UnsupportedArchitecture(
        f"{where}: architecture {named} is not supported; pdserve serves {supported()}"
    )


def family_for_gguf(arch: str | None, experts: bool, where: str) -> str:
    """The family of a GGUF file's `general.architecture`, with experts or without."""
    if experts and f"{arch}+experts" in _BY_GGUF:
        return _BY_GGUF[f"{arch}+experts"]
    if arch in _BY_GGUF:
        return _BY_GGUF[arch]
    names = ", ".join(n.replace("+experts", " with experts") for n in _BY_GGUF)
    raise UnsupportedArchitecture(
        f"{where}: GGUF architecture {arch!r} is not supported; GGUF files of {names} are "
        f"served (Hugging Face folders of {supported()})"
    )
