"""The engine on a CUDA GPU (skipped without one): the same greedy tokens as on CPU for whole,
batched, chunked and prefix-cached prefills, in float32; bfloat16 (the GPU default) runs."""

import pytest
import torch
from factories import make_engine, run_to_completion

from .test_engine_tiny import GREEDY, PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]


@pytest.fixture(scope="module")
def on_cpu(files):
    return [run_to_completion(make_engine(files), [p], GREEDY)[0] for p in PROMPTS]


def test_default_device_is_the_gpu(files):
    engine = make_engine(files, device="auto", dtype="auto")
    assert engine.runner.device.type == "cuda"
    assert engine.runner.dtype == torch.bfloat16
    assert all(t.is_cuda for t in engine.runner.k_caches)
    out = run_to_completion(engine, PROMPTS, GREEDY)
    assert [len(o) for o in out] == [12] * len(PROMPTS)


@pytest.mark.parametrize("chunk", [None, 5])
def test_gpu_matches_cpu_batched_and_chunked(files, on_cpu, chunk):
    engine = make_engine(files, device="cuda", chunk_size=chunk)
    assert run_to_completion(engine, PROMPTS, GREEDY) == on_cpu
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_gpu_prefix_hit_matches_cpu(files, on_cpu):
    engine = make_engine(files, device="cuda")
    assert run_to_completion(engine, [PROMPTS[1]], GREEDY) == [on_cpu[1]]
    hits = engine.stats()["prefix_hit_tokens"]
    assert run_to_completion(engine, [PROMPTS[1]], GREEDY) == [on_cpu[1]]
    assert engine.stats()["prefix_hit_tokens"] > hits
