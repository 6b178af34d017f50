"""Pipeline parallelism (`engine/pp/`): an engine of N stages (real processes, gloo) gives the
greedy tokens of one process, and their logprobs, for an even split and a chosen partition,
with prompts chunked so that stage 0 sends chunks on without waiting (the stages overlap), and
prompt logprobs (every row back from the last stage); each stage holds only its layers. Sizes
and partitions that cannot split the model are refused before any process starts, saying what
to change."""

from __future__ import annotations

import pytest
from factories import make_engine, make_model_files

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


@pytest.mark.parametrize(("pp", "partition"), [(2, None), (2, "1,3"), (4, None)])
def test_stages_give_the_tokens_of_one_process(files, one, pp, partition):
    many = generate(files, pipeline_parallel_size=pp, pp_layer_partition=partition)
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
        (dict(pipeline_parallel_size=2, tensor_parallel_size=2), "do not compose yet"),
        (dict(pipeline_parallel_size=2, role="decode"), "pipeline parallelism is for prefill"),
    ],
)  # fmt: skip
def test_a_split_that_cannot_work_is_refused_before_any_stage_starts(files, config, message):
    with pytest.raises(ValueError, match=message):
        make_engine(files, **config)
