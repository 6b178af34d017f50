"""Speculative decoding served: a disaggregated server whose decode pool speculates
(`--decode-args "--speculative-config ..."`: prompt lookup, or a draft model, here the bundled
model as its own draft) answers greedy requests with the tokens of the plain engine, and
reports proposed / accepted tokens in /health and /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from tests.servers import Server, metric_sum

SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
              "prompt_lookup_min": 1},
    "draft": {"method": "draft", "num_speculative_tokens": 3},  # "model": the bundled one
}  # fmt: skip
FLAGS = ("--weights", "bf16", "--dtype", "float32")  # batch-invariant: tokens comparable
PROMPT = "one two three four five one two three four five one two three four five one two"


@pytest.fixture(scope="module", params=list(SPECS))
def server(request):
    from pdserve.model.loader import load_model_config

    spec = SPECS[request.param]
    if spec["method"] == "draft":
        spec = {**spec, "model": str(load_model_config(None)[0])}
    with Server("--mode", "disagg", *FLAGS, "--decode-args",
                f"--speculative-config '{json.dumps(spec)}'") as s:  # fmt: skip
        yield s


def test_disaggregated_greedy_identical_and_metrics(server):
    engine = LLMEngine(EngineConfig(weights="bf16", dtype="float32"))
    ids = engine.encode(PROMPT)
    seq = engine.add_request(ids, SamplingParams(max_tokens=24, ignore_eos=True))
    while engine.has_work():
        engine.step()
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": ids, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]
    assert got["text"] == engine.tokenizer.decode(seq.output_token_ids)
    assert len(got["logprobs"]["tokens"]) == 24  # a logprob per emitted token
    decode = [w for w in server.wait_idle_and_clean().values() if w["role"] == "decode"]
    assert decode[0]["spec_verify_steps"] > 0 and decode[0]["spec_accepted_tokens"] > 0
    assert metric_sum(server.url, "pdserve_worker_spec_accepted_tokens") > 0
