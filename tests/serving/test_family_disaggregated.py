"""Disaggregated serving of other families: a prefill worker pushes the prompt's KV over tcp
into a decode worker (the sides driven in-process, as tests/serving/test_tp_disaggregated.py
does), which then gives a co-located engine's greedy tokens; for Mistral the prompt runs past
its sliding window, for Qwen3-MoE the decode side also runs tensor-parallel (2 ranks, each
holding half of every expert)."""

from __future__ import annotations

import pytest
from factories import make_engine, run_to_completion
from family_models import WINDOW, build, one_thread

from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.loader import load_model_files
from serving.test_tp_disaggregated import PROMPT, handoff

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


@pytest.mark.parametrize(("family", "p", "d"), [("mistral", 1, 1), ("qwen3_moe", 1, 2)])
def test_kv_pushed_over_tcp_gives_the_colocated_tokens(tmp_path, family, p, d):
    build(family, tmp_path)
    files = load_model_files(str(tmp_path))
    assert len(PROMPT) > WINDOW
    engine = make_engine(files)
    [reference] = run_to_completion(engine, [PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))
    tokens, done, _, _, _ = handoff(files, "tcp", p, d)
    assert done.error is None and done.first_token == reference[0]
    assert tokens == reference
