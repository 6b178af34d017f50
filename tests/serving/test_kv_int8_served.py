"""`--kv-cache-dtype int8` served disaggregated: the prefill worker writes 8-bit rows and pushes
them as they are (a layout of int8 rows), the decode worker decodes over them with the fused
step, and the answer is the offline engine's with the same cache, through the real openai client;
every block is freed after."""

from __future__ import annotations

import re

import httpx
import pytest
from servers import Server

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. " * 8


def test_an_int8_cache_serves_disaggregated_as_the_offline_engine_answers():
    from openai import OpenAI

    from pdserve import LLM, SamplingParams

    llm = LLM(kv_cache_dtype="int8")
    want = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    want = want[0].text
    del llm
    with Server(
        "--mode", "disagg", "--kv-cache-dtype", "int8", "--local-prefill-threshold", "0",
        "--kv-cache-gb", "0.25",
    ) as server:  # fmt: skip
        client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        got = client.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert got.usage.completion_tokens == 12
        assert got.choices[0].text == want
        text = httpx.get(server.url + "/metrics", timeout=10).text
        raw = re.search(r'^pdserve_kv_transfer_bytes_total\{encoding="raw"\} (\S+)$', text, re.M)
        assert raw and float(raw[1]) > 0, text[:2000]  # the prompt's rows went P -> D
        server.wait_idle_and_clean()
