"""Engine behaviour on a tiny random model: batching, chunking, prefix caching, preemption,
abort — every variant must produce the same greedy tokens and return every block."""

import os

import pytest
from factories import make_engine, run_to_completion

from pdserve.engine.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 2, 9, 71, 8], list(range(1, 40)), [200, 3, 3, 3, 250, 1, 1, 7, 9, 90, 11]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(files):
    """Each prompt alone, whole prefill, no prefix cache."""
    out = []
    for p in PROMPTS:
        eng = make_engine(files, enable_prefix_caching=False)
        out += run_to_completion(eng, [p], GREEDY)
    return out


def assert_idle_and_clean(engine):
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_batched_equals_one_at_a_time(files, reference):
    eng = make_engine(files)
    assert run_to_completion(eng, PROMPTS, GREEDY) == reference
    assert_idle_and_clean(eng)


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_prefill_equals_whole(files, reference, chunk):
    eng = make_engine(files, chunk_size=chunk)
    assert run_to_completion(eng, PROMPTS, GREEDY) == reference
    assert_idle_and_clean(eng)


def test_a_decode_worker_chunks_its_prefills_only_while_streams_run(files, reference):
    """Role decode: a prompt computed while nothing decodes takes one step, whatever the chunk;
    once a stream runs, later prompts go in chunks beside its tokens. Same tokens either way."""
    eng = make_engine(files, chunk_size=8, role="decode")
    a = eng.add_request(list(PROMPTS[1]), GREEDY)  # 39 tokens
    eng.step()
    assert a.num_computed_tokens == 39 and a.num_output_tokens == 1  # whole, first token out
    b = eng.add_request(list(PROMPTS[2]), GREEDY)  # 11 tokens, beside a's decoding
    eng.step()
    assert b.num_computed_tokens == 7  # a's token + 7 of b's: the chunk of 8
    while eng.has_work():
        eng.step()
    assert [a.output_token_ids, b.output_token_ids] == reference[1:]
    assert_idle_and_clean(eng)
    both = make_engine(files, chunk_size=8)  # a co-located worker always chunks
    c = both.add_request(list(PROMPTS[1]), GREEDY)
    both.step()
    assert c.num_computed_tokens == 8


def test_prefix_hit_equals_miss(files, reference):
    eng = make_engine(files)
    run_to_completion(eng, [PROMPTS[1]], GREEDY)
    hits_before = eng.block_manager.hits
    assert run_to_completion(eng, [PROMPTS[1]], GREEDY) == [reference[1]]
    assert eng.block_manager.hits - hits_before == 36  # 9 of 10 blocks of 4 (last recomputed)
    assert_idle_and_clean(eng)


def test_preemption_by_recompute_keeps_outputs(files, reference):
    # 10 blocks of 4 tokens cannot hold all three sequences at full length: some get preempted.
    eng = make_engine(files, kv_cache_gb=10 * 4 * 2 * 2 * 2 * 16 * 4 / (1 << 30))
    assert eng.block_manager.num_blocks == 10
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = run_to_completion(eng, [PROMPTS[0], PROMPTS[2], PROMPTS[0]], params)
    assert outs == [reference[0], reference[2], reference[0]]
    assert eng.scheduler.num_preemptions > 0
    assert_idle_and_clean(eng)


def test_abort_mid_generation_frees_blocks(files):
    eng = make_engine(files)
    a = eng.add_request(PROMPTS[1], GREEDY)
    b = eng.add_request(PROMPTS[0], GREEDY)
    eng.step()
    eng.step()
    assert eng.abort(a.request_id)
    assert not eng.abort("no-such-request")
    eng.check_integrity()
    while eng.has_work():
        eng.step()
    assert a.finish_reason == "abort" and b.finish_reason == "length"
    assert_idle_and_clean(eng)


def test_stop_token_and_max_tokens(files, reference):
    eng = make_engine(files)
    stop_at = reference[0][3]
    first = reference[0].index(stop_at)
    out = run_to_completion(
        eng, [PROMPTS[0]], SamplingParams(max_tokens=12, stop_token_ids=(stop_at,))
    )
    assert out == [reference[0][: first + 1]]
    out = run_to_completion(eng, [PROMPTS[0]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert out == [reference[0][:2]]


def test_seeded_sampling_is_reproducible_and_topk1_is_greedy(files, reference):
    eng = make_engine(files)
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    a = run_to_completion(eng, [PROMPTS[2]], p)
    b = run_to_completion(eng, [PROMPTS[2]], p)
    assert a == b
    c = run_to_completion(
        eng, [PROMPTS[2]], SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True)
    )
    assert c != a
    k1 = SamplingParams(max_tokens=12, temperature=0.8, top_k=1, ignore_eos=True)
    assert run_to_completion(eng, [PROMPTS[2]], k1) == [reference[2]]
    p1 = SamplingParams(max_tokens=12, temperature=0.8, top_p=1e-6, ignore_eos=True)
    assert run_to_completion(eng, [PROMPTS[2]], p1) == [reference[2]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": -3}, "max_tokens must be >= 1"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0}, "top_p must be in"),
        ({"stop": (3,)}, "stop must be non-empty strings"),
        ({"stop_token_ids": ("x",)}, "stop_token_ids must be non-negative integers"),
    ],
)
def test_bad_sampling_params_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_say_what_to_change(files):
    eng = make_engine(files, max_model_len=64)
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(ValueError, match="context window is 64"):
        eng.add_request(list(range(1, 65)), GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([1, 999], GREEDY)
    assert not eng.has_work()


def test_decodes_of_very_different_lengths_are_grouped_and_match_single(files):
    long_prompt = [(7 * i) % 250 + 1 for i in range(150)]  # 38 blocks vs 2: separate groups
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    single = [
        run_to_completion(make_engine(files), [p], params)[0] for p in (PROMPTS[0], long_prompt)
    ]
    eng = make_engine(files)
    assert run_to_completion(eng, [PROMPTS[0], long_prompt, PROMPTS[2]], params)[:2] == single
    assert_idle_and_clean(eng)
    seqs = [eng.make_sequence(p, params, f"g{i}") for i, p in enumerate((PROMPTS[0], long_prompt))]
    for s in seqs:  # shaped as two sequences mid-decode
        assert eng.block_manager.allocate(s)
        s.num_computed_tokens = s.num_tokens - 1
    from pdserve.engine.scheduler import ScheduledBatch

    meta = eng.runner._prepare(ScheduledBatch(seqs, [1, 1]))[2]
    assert [(g.start, g.end) for g in meta.decode_groups] == [(0, 1), (1, 2)]
    for s in seqs:
        eng.block_manager.free(s)


def test_step_log_records_every_step_in_the_simulators_terms(files, reference, tmp_path,
                                                             monkeypatch):  # fmt: skip
    """PDSERVE_STEP_LOG: one line per step, with what it computed (`pdserve.sim.served` reads
    them back); chunk 8 over a 7-token and a 39-token prompt gives a known schedule."""
    from pdserve.sim.served import read_steps

    monkeypatch.setenv("PDSERVE_STEP_LOG", str(tmp_path / "steps"))
    eng = make_engine(files, chunk_size=8)
    assert run_to_completion(eng, PROMPTS[:2], GREEDY) == reference[:2]
    steps = read_steps(tmp_path / "steps")
    assert {s.log for s in steps} == {f"steps-{eng.config.role}-{os.getpid()}.jsonl"}
    first, second = steps[0].batch, steps[1].batch
    # step 1: 7 tokens of prompt A and 1 of B; step 2: A's first decode and 7 more of B
    assert (first.tokens, first.seqs, first.kv_read, steps[0].prefill_tokens) == (8, 2, 0, 8)
    assert first.attn_pairs == 7 * 3.5 + 1 * 0.5 and first.sampled == 1
    assert (second.tokens, second.seqs, second.kv_read, steps[1].prefill_tokens) == (8, 2, 7 + 1, 7)
    assert second.sampled == 1 and steps[1].decodes and not steps[0].decodes
    # every token computed is in the log: both prompts and every output token but the last
    assert sum(s.batch.tokens for s in steps) == 7 + 39 + 2 * (GREEDY.max_tokens - 1)
    assert all(s.seconds > 0 for s in steps) and steps == sorted(steps, key=lambda s: s.t)


def test_gpu_kv_budget_is_a_share_of_total_memory_capped_by_what_is_free():
    from pdserve.engine.model_runner import gpu_kv_budget

    gib = 1 << 30
    first = gpu_kv_budget(79 * gib, 80 * gib, 0.25)
    second = gpu_kv_budget(79 * gib - first, 80 * gib, 0.25)  # a second worker on the GPU
    assert first == second == 20 * gib
    assert gpu_kv_budget(10 * gib, 80 * gib, 0.25) == 9 * gib  # mostly taken: 90 % of the rest
