"""The one typed place where pdserve reads environment variables.

Each variable is read by one function here. The names are constants too, for the few places
that set a variable for a child process or a library (`pdserve serve --step-log` sets
`STEP_LOG` for its workers) or name it in a message.
"""

from __future__ import annotations

import os
from pathlib import Path

API_KEY = "PDSERVE_API_KEY"
CACHE_DIR = "PDSERVE_CACHE_DIR"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
KV_FAULT = "PDSERVE_KV_FAULT"
KV_STAGING = "PDSERVE_KV_STAGING"
LD_LIBRARY_PATH = "LD_LIBRARY_PATH"
# oneDNN's primitive cache and PyTorch's own cache of oneDNN matmul primitives (ideep)
KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
KERNEL_CACHE_ENTRIES = 64
# Mooncake's own: how much its client library logs (TRACE, INFO, WARNING, ERROR)
MC_LOG_LEVEL = "MC_LOG_LEVEL"
MC_LOG_LEVEL_DEFAULT = "WARNING"  # pdserve's default; Mooncake's is INFO
MODEL = "PDSERVE_MODEL"
QUANT_MAX_ROWS = "PDSERVE_QUANT_MAX_ROWS"
INT8_ACT_ROWS = "PDSERVE_INT8_ACT_ROWS"
NIXL_LOG_LEVEL = "NIXL_LOG_LEVEL"
# OpenTelemetry's own variables (read by its SDK too: OTEL_TRACES_SAMPLER, OTEL_BSP_*, ...)
OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
SECRET = "PDSERVE_SECRET"
SECRET_FILE = "PDSERVE_SECRET_FILE"
STEP_LOG = "PDSERVE_STEP_LOG"


def bound_kernel_caches() -> None:
    """Bound the CPU kernel caches keyed by tensor shape before torch creates any kernel.
    Every prompt length that has not been seen adds oneDNN matmul primitives (JIT code and
    scratchpads) to two caches of 1,024 entries each: a prefill worker's RSS grew ~6 MB per
    new long prompt and went on growing for hours. With 64 entries it is flat (prefill and
    decode speed unchanged within noise); an operator's own setting of either variable wins."""
    for name in KERNEL_CACHES:
        os.environ.setdefault(name, str(KERNEL_CACHE_ENTRIES))


def for_workers(prefixes: tuple[str, ...]) -> dict[str, str]:
    """The variables whose names start with one of `prefixes`: what a launcher that does not
    start its workers as children (Ray) hands them explicitly."""
    return {k: v for k, v in os.environ.items() if k.startswith(prefixes)}


def cache_dir() -> Path:
    """Where derived artefacts (e.g. a tokenizer extracted from a GGUF file) are cached."""
    return Path(os.environ.get(CACHE_DIR, Path.home() / ".cache" / "pdserve"))


def quant_max_rows() -> int | None:
    """`PDSERVE_QUANT_MAX_ROWS`: rows up to which every quantized linear uses its quantized
    kernel (unset: measured per machine and shape, model/kernel_rows.py)."""
    return _rows(QUANT_MAX_ROWS)


def int8_act_rows() -> int | None:
    """`PDSERVE_INT8_ACT_ROWS`: rows up to which a quantized linear runs int8 activations above
    its quantized kernel's rows (model/act_quant.py; unset: measured, or none at all when
    `PDSERVE_QUANT_MAX_ROWS` fixes the quantized kernel's rows)."""
    return _rows(INT8_ACT_ROWS)


def _rows(name: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{name} must be a whole number of rows, got {value!r}")
    return int(value)


def library_path() -> list[str]:
    """`LD_LIBRARY_PATH`'s folders (a child given more keeps these after them)."""
    return [p for p in os.environ.get(LD_LIBRARY_PATH, "").split(":") if p]


def mooncake_log_level() -> str:
    """`MC_LOG_LEVEL`, Mooncake's own variable: how much its client library logs (TRACE, INFO,
    WARNING or ERROR; any other value is INFO to it). Unset: WARNING, where Mooncake's default
    is INFO (each client's every step of joining and leaving the pool, each failed call)."""
    return os.environ.get(MC_LOG_LEVEL) or MC_LOG_LEVEL_DEFAULT


def model_path() -> str | None:
    """`PDSERVE_MODEL`: default model path when `--model` is not given (bundled model if unset)."""
    return os.environ.get(MODEL) or None


def api_key() -> str | None:
    """`PDSERVE_API_KEY`: the router's default `--api-key` (None: no key required). Set but
    empty, it is the empty key, as `--api-key ''` would be."""
    return os.environ.get(API_KEY)


def secret_text() -> str | None:
    """`PDSERVE_SECRET`: the shared secret of internal channels, as given (None: unset).
    `kv_transfer.wire.secret_from_env` checks it and prefers it to `secret_file()`."""
    return os.environ.get(SECRET)


def secret_file() -> str | None:
    """`PDSERVE_SECRET_FILE`: the path of a file that holds the shared secret (None: unset)."""
    return os.environ.get(SECRET_FILE)


def otlp_traces_endpoint() -> str | None:
    """`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (else `OTEL_EXPORTER_OTLP_ENDPOINT`): where
    tracing sends spans (unset: tracing is off; pdserve/tracing.py)."""
    return os.environ.get(OTLP_TRACES_ENDPOINT) or os.environ.get(OTLP_ENDPOINT) or None


def otlp_traces_protocol() -> str:
    """`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (else `OTEL_EXPORTER_OTLP_PROTOCOL`): grpc or
    http/protobuf (the default)."""
    value = os.environ.get(OTLP_TRACES_PROTOCOL) or os.environ.get(OTLP_PROTOCOL)
    return value or "http/protobuf"


def step_log_dir() -> Path | None:
    """`PDSERVE_STEP_LOG`: a directory where every engine logs its steps (see `StepLog`)."""
    value = os.environ.get(STEP_LOG)
    return Path(value) if value else None


def kv_fault() -> tuple[tuple[str, ...], int] | None:
    """`PDSERVE_KV_FAULT=KIND[+KIND...]:EVERY` (tests only): the tcp or nixl KV connector breaks
    every EVERY-th layer, each time the next of the KINDs in turn: the sender's (reset,
    truncate, corrupt) or the receiver's (stall), not both; see kv_transfer/wire_faults.py
    `TcpFault`."""
    value = os.environ.get(KV_FAULT)
    if not value:
        return None
    named, _, every = value.partition(":")
    kinds = tuple(named.split("+"))
    sender = {"reset", "truncate", "corrupt"}
    if not (set(kinds) <= sender or kinds == ("stall",)) or not every.isdigit() or int(every) < 1:
        raise ValueError(
            f"{KV_FAULT}={value!r}: expected KIND[+KIND...]:EVERY with KINDs of reset, truncate "
            "and corrupt, or stall alone, and EVERY >= 1 (a test-only switch)"
        )
    return kinds, int(every)


def kv_staging() -> bool:
    """`PDSERVE_KV_STAGING=1`: stage KV transfers through host blocks even for a CPU cache (as a
    GPU cache always is); the tests use it to run the GPU path's bookkeeping on CPU."""
    return os.environ.get(KV_STAGING, "").lower() in ("1", "true", "yes")


def cuda_visible_devices() -> list[str] | None:
    """`CUDA_VISIBLE_DEVICES` as its list of device ids, blanks dropped (None: unset, so every
    GPU is visible; empty or starting with "-1": none is)."""
    value = os.environ.get(CUDA_VISIBLE_DEVICES)
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]
