"""The real `openai` client against `pdserve serve`: disaggregated vs co-located vs offline."""

from __future__ import annotations

import httpx
import openai
import pytest
from servers import Server, metric

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
LONG = "Summarize the following notes. " + " ".join(
    f"Note {i}: the warehouse in district {i % 7} shipped {i * 13 % 97} crates on day {i}."
    for i in range(60)
)
PROMPTS = ["The capital of France is", "def add(a, b):", LONG]
MAX_TOKENS = 20
# Tensor-parallel pools decode eagerly, 6 ranks on this machine's 2 cores (~0.25 s a token):
# 8 tokens are 7 decode steps over the pushed, re-sharded KV, at 2/5 of the 20 tokens' time.
TP_TOKENS = 8


@pytest.fixture(scope="module")
def offline():
    llm = LLM(dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return {p: llm.generate(p, params)[0].token_ids for p in PROMPTS}, llm.tokenizer


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def completion_ids(
    server, prompt: str, tokenizer, stream: bool, model: str = MODEL, max_tokens: int = MAX_TOKENS
) -> list[int]:
    kw = dict(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    c = client(server)
    if stream:
        text = "".join(
            ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices
        )
    else:
        r = c.completions.create(**kw)
        assert r.usage.completion_tokens == max_tokens
        assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
        text = r.choices[0].text
    return text


def test_long_prompt_is_over_1000_tokens(offline):
    _, tok = offline
    assert len(tok.encode(LONG)) > 1000


@pytest.mark.parametrize("stream", [False, True])
def test_disagg_and_colocated_match_offline(disagg_server, colocated_server, offline, stream):
    expected, tok = offline
    for prompt in PROMPTS:
        want = tok.decode(expected[prompt])
        assert completion_ids(disagg_server, prompt, tok, stream) == want, prompt
        assert completion_ids(colocated_server, prompt, tok, stream) == want, prompt
    disagg_server.wait_idle_and_clean()  # raises naming what is still busy or leaked
    colocated_server.wait_idle_and_clean()


def test_float32_workers_default_to_dense_weights_and_the_fused_decode_step(disagg_server):
    """On CPU in float32 (torch's int4 kernel has no fast float32 path; bfloat16 workers take
    int4: tests/model/test_quant.py), every worker's ready line says so."""
    ready = [line for line in disagg_server.lines if ") ready: " in line]
    assert len(ready) == 2, disagg_server.lines
    assert all("weights bf16, decode fused (" in line for line in ready), ready


def test_remote_prefill_was_used(disagg_server):
    metrics = httpx.get(disagg_server.url + "/metrics").text
    remote = [
        line
        for line in metrics.splitlines()
        if line.startswith('pdserve_prefill_decisions_total{where="remote"}')
    ]
    assert remote and float(remote[0].split()[-1]) >= 3
    kv = [
        line for line in metrics.splitlines() if line.startswith("pdserve_kv_transfer_bytes_total")
    ]
    assert float(kv[0].split()[-1]) > 0


@pytest.mark.parametrize("stream", [False, True])
def test_chat_streaming_and_not(disagg_server, stream):
    c = client(disagg_server)
    kw = dict(
        model=MODEL,
        # not the bare question: its first token is a near tie in bf16 (test_real_model.py
        # `test_cli_generate_answers_paris`)
        messages=[
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
        ],
        max_tokens=24,
        temperature=0,
    )
    if stream:
        chunks = list(
            c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        r = c.chat.completions.create(**kw)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    assert "Paris" in text


def test_models_health_and_metrics(disagg_server):
    models = client(disagg_server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = disagg_server.health()
    assert health["status"] == "ok"
    assert sorted(w["role"] for w in health["workers"].values()) == ["decode", "prefill"]
    text = httpx.get(disagg_server.url + "/metrics").text
    for name in (
        "pdserve_ttft_seconds",
        "pdserve_itl_seconds",
        "pdserve_e2e_seconds",
        "pdserve_worker_free_blocks",
    ):
        assert name in text


def test_stop_string(disagg_server):
    r = client(disagg_server).completions.create(
        model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0, stop=[" 8"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text.endswith("7,") and "8" not in r.choices[0].text


def test_cancel_mid_stream_frees_every_block(disagg_server):
    with httpx.stream(
        "POST",
        disagg_server.url + "/v1/completions",
        timeout=120,
        json={"prompt": LONG, "max_tokens": 200, "stream": True, "ignore_eos": True},
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break  # closing the response disconnects the client mid-stream
    disagg_server.wait_idle_and_clean()  # every block free, block manager intact


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b'{"prompt": "hi", "model": "gpt-9"}', 404, "is not served here"),
    (b'{"prompt": "hi", "max_tokens": -5}', 400, "max_tokens must be >= 1"),
    (b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
    (b'{"prompt": 42}', 400, "prompt"),
    (b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    (b'{"prompt": "hi", "n": 30}', 400, "n must be in [1, 16]"),
    (b'{"prompt": "hi", "frobnicate": 1}', 400, "unknown field 'frobnicate'"),
    (b'{"prompt": "hi", "suffix": "x"}', 400, "suffix"),
    (b'{"prompt": "hi", "logprobs": 21}', 400, "logprobs must be in [0, 20]"),
    (b'{"prompt": "hi", "logit_bias": {"x": 1}}', 400, "logit_bias keys are token ids"),
    (b'{"prompt": "hi", "response_format": {"type": "yaml"}}', 400, "yaml"),
    (b'{"prompt": ""}', 400, "prompt is empty"),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD)
def test_bad_input_gets_openai_error_and_server_keeps_serving(disagg_server, body, status, message):
    r = httpx.post(
        disagg_server.url + "/v1/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error"
    assert httpx.get(disagg_server.url + "/health").status_code == 200


def test_prompt_over_context_window(disagg_server):
    r = httpx.post(disagg_server.url + "/v1/completions", json={"prompt": [5] * 9000}, timeout=30)
    assert r.status_code == 400
    assert "context window is 8192" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client(disagg_server).chat.completions.create(model=MODEL, messages=[], max_tokens=4)


# Re-sharding both ways through `pdserve serve` (~50 s each here); equal sizes and the other
# pairings of each transport are tests/serving/test_tp_disaggregated.py's, in-process.
@pytest.mark.parametrize("prefill_tp, decode_tp, transport", [(1, 3, "tcp"), (3, 1, "nixl")])
def test_prefill_and_decode_pools_of_different_tensor_parallel_sizes_match_offline(
    offline, prefill_tp, decode_tp, transport
):
    """Per-phase TP with the bundled model (9 query heads, 3 KV heads: TP 3 gives each rank
    one KV head): the prefill pool's KV is re-sharded into the decode group's ranks."""
    if transport == "nixl":
        pytest.importorskip("nixl_cu12", reason="NIXL is not installed")
    expected, tok = offline
    with Server(
        "--mode", "disagg", "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
        "--kv-transport", transport, "--dtype", "float32", "--local-prefill-threshold", "0",
        "--kv-cache-gb", "0.2",
    ) as server:  # fmt: skip
        for prompt in PROMPTS:
            want = tok.decode(expected[prompt][:TP_TOKENS])
            assert completion_ids(server, prompt, tok, False, max_tokens=TP_TOKENS) == want
        # every prompt was pushed; the decode ranks received 1/3 of the layer's heads each
        layout_bytes = 30 * 2 * 16 * 64 * 4  # layers x K,V x block tokens x head dim x float32
        pushed = metric(server.url, 'pdserve_kv_transfer_bytes_total{encoding="raw"}')
        blocks = sum(-(-len(tok.encode(p)) // 16) for p in PROMPTS)
        assert pushed == blocks * layout_bytes * 3  # 3 KV heads, each sent to the rank(s) of it
        server.wait_idle_and_clean()
