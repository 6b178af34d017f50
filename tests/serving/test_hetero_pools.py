"""Pools on different "hardware" on this machine (issue 39): the prefill pool on dense bf16
weights, the decode pool on int4 with its own thread count, chosen per pool with
--prefill-args / --decode-args. Greedy requests get the text the co-located engine gives with
the decode pool's weights (a prefill of more rows than any quantized kernel takes, LADDER's
last, computes on the dense weights in every format, so the prompt's KV and first token do not
depend on the prefill pool's format)."""

from __future__ import annotations

import httpx
import pytest
from servers import Server
from waiting import wait_until

pytestmark = pytest.mark.slow

PROMPTS = [  # each longer than LADDER[-1] tokens (test_the_prompts_prefill_on_the_dense_weights)
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is "
    "Madrid. The capital of Portugal is Lisbon. The capital of Austria is Vienna. The capital "
    "of Poland is Warsaw. The capital of Greece is Athens. The capital of Norway is Oslo. The "
    "capital of Denmark is Copenhagen. The capital of Sweden is Stockholm. The capital of "
    "Finland is Helsinki. The capital of Ireland is Dublin. The capital of Belgium is Brussels. "
    "The capital of the Netherlands is Amsterdam. The capital of Switzerland is Bern. The "
    "capital of Hungary is Budapest. The capital of Romania is Bucharest. The capital of "
    "Bulgaria is Sofia. The capital of Croatia is Zagreb. The capital of Italy is",
    "Counting to eighty: one, two, three, four, five, six, seven, eight, nine, ten, eleven, "
    "twelve, thirteen, fourteen, fifteen, sixteen, seventeen, eighteen, nineteen, twenty, "
    "twenty-one, twenty-two, twenty-three, twenty-four, twenty-five, twenty-six, twenty-seven, "
    "twenty-eight, twenty-nine, thirty, thirty-one, thirty-two, thirty-three, thirty-four, "
    "thirty-five, thirty-six, thirty-seven, thirty-eight, thirty-nine, forty, forty-one, "
    "forty-two, forty-three, forty-four, forty-five, forty-six,",
]
MAX_TOKENS = 12


def colocated_texts() -> list[str]:
    """What a co-located worker with the decode pool's settings answers, one request at a
    time (the offline engine it runs)."""
    from pdserve import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", weights="int4", num_threads=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return [llm.generate(p, params)[0].text for p in PROMPTS]


def test_the_prompts_prefill_on_the_dense_weights():
    """The few-row int4 kernel serves up to LADDER[-1] rows where it wins (kernel_rows.py): a
    shorter prompt would prefill partly on int4 in the co-located reference and on bf16 in
    the prefill pool, and their texts could differ for that alone."""
    from pdserve.model.kernel_rows import LADDER
    from pdserve.model.loader import load_tokenizer

    tok = load_tokenizer()
    assert all(len(tok.encode(p)) > LADDER[-1] for p in PROMPTS)


def test_pools_with_their_own_weight_formats_and_threads_give_the_colocated_text():
    with Server(
        "--mode", "disagg", "--dtype", "bfloat16", "--local-prefill-threshold", "0",
        "--kv-cache-gb", "0.25", "--prefill-args", "--weights bf16 --threads 1",
        "--decode-args", "--weights int4 --threads 1",
    ) as server:  # fmt: skip
        got = []
        for prompt in PROMPTS:  # one at a time: decode batches of one, as the reference's
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        for role, fmt in (("prefill", "bf16"), ("decode", "int4")):
            line = f"({role}) ready: weights {fmt}"
            wait_until(lambda line=line: any(line in x for x in server.lines), 30,
                       f"the {role} worker's ready line says {fmt}",
                       state=lambda: server.lines[-10:])  # fmt: skip
        server.wait_idle_and_clean()
    assert got == colocated_texts()
