"""Pipeline parallelism (`engine/pp/`): an engine of N stages (real processes, gloo) gives the
greedy tokens of one process, and their logprobs, for an even split and a chosen partition,
with prompts chunked so that stage 0 sends chunks on without waiting (the stages overlap), and
prompt logprobs (every row back from the last stage), also with each stage a tensor-parallel
group; each stage holds only its layers. Sizes
and partitions that cannot split the model are refused before any process starts, saying what
to change."""

from __future__ import annotations

import pytest
from factories import make_engine, make_model_files
from servers import children, cmdline

from pdserve.engine.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9] * 7, [1, 2, 3], list(range(10, 60))]  # 35, 3 and 50 tokens
MODEL = dict(num_layers=4)


@pytest.fixture(scope="module")
def files():
    return make_model_files(seed=3, **MODEL)


def generate(files, **config) -> dict[str, tuple[list[int], list[float]]]:
    """{request id: (greedy tokens, their logprobs)}; chunks of 8 tokens: a prompt is several
    steps, all but the last not waited for by a pipeline's stage 0."""
    engine = make_engine(files, chunk_size=8, **config)
    try:
        out: dict[str, tuple[list[int], list[float]]] = {}
        for prompt in PROMPTS:
            engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0, logprobs=0))
        while engine.has_work():
            for o in engine.step():
                tokens, logprobs = out.setdefault(o.seq.request_id, ([], []))
                tokens.append(o.new_token)
                logprobs.append(o.logprobs.logprob)
        engine.check_integrity()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return out
    finally:
        engine.close()


@pytest.fixture(scope="module")
def one(files):
    return generate(files)


@pytest.mark.parametrize(
    ("pp", "partition", "tp"), [(2, None, 1), (2, "1,3", 1), (4, None, 1), (2, "1,3", 2)]
)
def test_stages_give_the_tokens_of_one_process(files, one, pp, partition, tp):
    """tp 2: each stage a tensor-parallel group of 2 ranks (4 processes): stage 0's ranks
    embed and run its layer, stage 1's run theirs over the hidden states that came down."""
    many = generate(files, pipeline_parallel_size=pp, pp_layer_partition=partition,
                    tensor_parallel_size=tp)  # fmt: skip
    assert {r: t for r, (t, _) in many.items()} == {r: t for r, (t, _) in one.items()}
    for r, (_, logprobs) in many.items():  # the same ops per layer; threads may differ
        assert logprobs == pytest.approx(one[r][1], abs=1e-4)


def test_each_stage_holds_its_layers_and_stage_0_sees_every_cache(files):
    engine = make_engine(files, pipeline_parallel_size=2, pp_layer_partition="1,3")
    try:
        runner = engine.runner
        assert [list(r) for r in runner.pp.layers] == [[0], [1, 2, 3]]
        assert list(runner.model.layer_ids) == [0] and len(runner.model.layers) == 1
        assert runner.decode_path == "eager (pipeline parallel, 2 stages)"
        shapes = {tuple(k.shape) for k in runner.k_caches}  # stage 1's mapped from its memfd
        assert len(runner.k_caches) == 4 and len(shapes) == 1 and 0 not in next(iter(shapes))
        params = SamplingParams(max_tokens=1, prompt_logprobs=1)
        seq = engine.add_request(PROMPTS[0], params)
        while engine.has_work():
            engine.step()
        assert len(seq.prompt_logprobs) == len(PROMPTS[0]) - 1
    finally:
        engine.close()
    assert all(p.poll() is not None for p in runner.pp.procs)  # the stages stopped


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(pipeline_parallel_size=5), "--pipeline-parallel-size 5 is larger than the "
         "model's 4 layers"),
        (dict(pipeline_parallel_size=2, pp_layer_partition="1,2"), "adds up to 3 layers; the "
         "model has 4"),
        (dict(pipeline_parallel_size=2, pp_layer_partition="1,1,2"), "names 3 stages"),
        (dict(pp_layer_partition="2,2"), "add --pipeline-parallel-size"),
        (dict(pipeline_parallel_size=2, role="decode"), "pipeline parallelism is for prefill"),
    ],
)  # fmt: skip
def test_a_split_that_cannot_work_is_refused_before_any_stage_starts(files, config, message):
    with pytest.raises(ValueError, match=message):
        make_engine(files, **config)


def test_a_stage_of_two_ranks_holds_half_the_heads_of_its_layers_only(files):
    """PP 2 x TP 2: stage 0 is rank 0 of its own group (a rank process of its own), stage 1 a
    process that started its own rank; each rank's cache holds its stage's layers alone."""
    engine = make_engine(files, pipeline_parallel_size=2, tensor_parallel_size=2,
                         pp_layer_partition="1,3")  # fmt: skip
    try:
        runner = engine.runner
        cfg = engine.model_config
        assert (runner.pp.size, runner.tp.size) == (2, 2)
        assert (runner.model.n_heads, list(runner.model.layer_ids)) == (cfg.num_heads // 2, [0])
        for k, _ in runner.rank_caches:  # this stage's ranks: layer 0 only
            assert [t.numel() > 0 for t in k] == [True, False, False, False]
        [stage] = runner.pp.procs
        ranks = [c for c in children(stage.pid) if "pdserve.engine.tp" in cmdline(c)]
        assert len(ranks) == 1 and len(runner.tp.procs) == 1
    finally:
        engine.close()
    assert all(p.poll() is not None for p in (*runner.pp.procs, *runner.tp.procs))
