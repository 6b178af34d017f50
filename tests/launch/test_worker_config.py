"""`pdserve worker`'s flags -> WorkerConfig: what each role's engine is given, and the
combinations refused before a model loads."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.config import WORKER_CHUNK_SIZE
from pdserve.launch.local import worker_config


def _config(*flags: str):
    args = build_parser().parse_args(["worker", "--router", "127.0.0.1:5555", *flags])
    return worker_config(args)


def test_a_prefill_worker_computes_prompts_in_chunks_so_an_abort_stops_it_between_them():
    assert _config("--role", "prefill").engine.chunk_size == WORKER_CHUNK_SIZE["prefill"] > 0
    assert _config("--role", "prefill", "--chunk-size", "256").engine.chunk_size == 256


def test_a_colocated_worker_chunks_by_default_so_a_step_under_load_stays_bounded():
    assert _config("--role", "both").engine.chunk_size == WORKER_CHUNK_SIZE["both"] > 0
    assert _config("--role", "both", "--chunk-size", "512").engine.chunk_size == 512


def test_chunk_size_zero_means_whole_prompts_and_a_decode_worker_keeps_what_it_is_given():
    assert _config("--role", "both", "--chunk-size", "0").engine.chunk_size is None
    assert _config("--role", "prefill", "--chunk-size", "0").engine.chunk_size is None
    assert _config("--role", "decode").engine.chunk_size is None
    assert _config("--role", "decode", "--chunk-size", "64").engine.chunk_size == 64


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
