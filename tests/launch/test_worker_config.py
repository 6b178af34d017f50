"""`pdserve worker`'s flags -> WorkerConfig: what each role's engine is given, and the
combinations refused before a model loads."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.launch.local import worker_config
from pdserve.serving.prefill_side import PREFILL_CHUNK_TOKENS


def _config(*flags: str):
    args = build_parser().parse_args(["worker", "--router", "127.0.0.1:5555", *flags])
    return worker_config(args)


def test_a_prefill_worker_computes_prompts_in_chunks_so_an_abort_stops_it_between_them():
    assert _config("--role", "prefill").engine.chunk_size == PREFILL_CHUNK_TOKENS
    assert _config("--role", "prefill", "--chunk-size", "256").engine.chunk_size == 256


def test_a_decode_or_colocated_worker_keeps_its_chunk_size():
    assert _config("--role", "decode").engine.chunk_size is None
    assert _config("--role", "both", "--chunk-size", "512").engine.chunk_size == 512


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--kv-transport", "nixl", "--kv-compression", "fp8"), "needs --kv-transport tcp"),
        (("--tensor-parallel-size", "2", "--kv-store", "tcp://127.0.0.1:1"), "KV store"),
    ],
)
def test_a_combination_no_worker_can_serve_is_refused_saying_what_to_change(flags, message):
    with pytest.raises(ValueError, match=message):
        _config("--role", "decode", *flags)
