"""The one typed place where pdserve reads environment variables."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where derived artefacts (e.g. a tokenizer extracted from a GGUF file) are cached."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def model_path() -> str | None:
    """`PDSERVE_MODEL`: default model path when `--model` is not given (bundled model if unset)."""
    return os.environ.get("PDSERVE_MODEL") or None


def step_log_dir() -> Path | None:
    """`PDSERVE_STEP_LOG`: a directory where every engine logs its steps (see `StepLog`)."""
    value = os.environ.get("PDSERVE_STEP_LOG")
    return Path(value) if value else None


def kv_staging() -> bool:
    """`PDSERVE_KV_STAGING=1`: stage KV transfers through host blocks even for a CPU cache (as a
    GPU cache always is); the tests use it to run the GPU path's bookkeeping on CPU."""
    return os.environ.get("PDSERVE_KV_STAGING", "").lower() in ("1", "true", "yes")
