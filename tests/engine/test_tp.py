"""Tensor parallelism (`engine/tp/`): an engine of N ranks (real processes, gloo) gives the
greedy tokens of one rank, and logprobs within a stated tolerance, for every N the model's head
counts allow: KV heads split (N divides them) and replicated (N a multiple of them). Sizes that
cannot split a model are refused before any process starts, with the sizes that would."""

from __future__ import annotations

import pytest
from factories import make_engine, make_model_files

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tp import TPShard

PROMPTS = [[5, 6, 7, 8, 9] * 3, [1, 2, 3], list(range(10, 40))]
# float32: the ranks' partial sums are added in another order than one rank's matmul
LOGPROB_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}


def generate(files, tp: int, dtype: str = "float32", **config):
    """{prompt index: (greedy tokens, their logprobs)} of an engine of `tp` ranks."""
    engine = make_engine(files, tensor_parallel_size=tp, dtype=dtype, **config)
    try:
        for prompt in PROMPTS:
            engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, logprobs=0))
        out: dict[str, tuple[list[int], list[float]]] = {}
        while engine.has_work():
            for o in engine.step():
                tokens, logprobs = out.setdefault(o.seq.request_id, ([], []))
                tokens.append(o.new_token)
                logprobs.append(o.logprobs.logprob)
        return out
    finally:
        engine.close()


@pytest.mark.parametrize(
    "heads, kv_heads, sizes",
    [(6, 2, (2, 6)), (6, 3, (3, 6))],  # 2 | 2 and 3 | 3: split; 6: each KV head on 3 or 2 ranks
)
def test_every_size_gives_the_tokens_of_one_rank(heads, kv_heads, sizes):
    files = make_model_files(num_heads=heads, num_kv_heads=kv_heads, hidden_size=96,
                             intermediate_size=192)  # fmt: skip
    one = generate(files, 1)
    for tp in sizes:
        many = generate(files, tp)
        assert {r: t for r, (t, _) in many.items()} == {r: t for r, (t, _) in one.items()}, tp
        for r, (_, logprobs) in many.items():
            assert logprobs == pytest.approx(one[r][1], abs=LOGPROB_TOLERANCE["float32"])


def test_bfloat16_ranks_stay_within_tolerance():
    files = make_model_files(num_heads=6, num_kv_heads=2, hidden_size=96, intermediate_size=192)
    one, two = generate(files, 1, "bfloat16"), generate(files, 2, "bfloat16")
    first = {r: lp[0] for r, (_, lp) in one.items()}  # the first token: same prompt, same cache
    assert {r: lp[0] for r, (_, lp) in two.items()} == pytest.approx(
        first, abs=LOGPROB_TOLERANCE["bfloat16"]
    )


def test_a_size_that_does_not_split_the_model_is_refused_with_the_sizes_that_would():
    cfg = make_model_files(num_heads=6, num_kv_heads=2, hidden_size=96,
                           intermediate_size=192).config  # fmt: skip
    with pytest.raises(ValueError, match=r"sizes that work: 1, 2, 6"):
        TPShard(0, 3).check(cfg)  # 3 neither divides the 2 KV heads nor is a multiple of them
    with pytest.raises(ValueError, match="does not split"):
        make_engine(make_model_files(num_heads=6, num_kv_heads=2, hidden_size=96,
                                     intermediate_size=192), tensor_parallel_size=4)  # fmt: skip


def test_each_rank_holds_its_heads():
    cfg = make_model_files(num_heads=6, num_kv_heads=2, hidden_size=96).config
    assert [TPShard(r, 2).kv_heads(cfg) for r in range(2)] == [range(0, 1), range(1, 2)]
    assert [TPShard(r, 6).kv_heads(cfg).start for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert TPShard(0, 6).local_heads(cfg) == (1, 1)
