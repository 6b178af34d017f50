"""OpenAI API parity with the official `openai` client against `pdserve serve`, co-located and
disaggregated: n, logprobs (and echo's prompt logprobs), penalties, logit_bias, structured
outputs, tools, /tokenize and /detokenize."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from servers import Server, metric
from waiting import wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "The capital of France is"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "size": {"enum": ["small", "large"]},
    },
    "required": ["city", "population", "size"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def tools_server():
    """Co-located, with the shipped Llama-3 JSON tool template (SmolLM2's own has no tools)."""
    with Server(
        "--mode", "colocated", "--dtype", "float32", "--chat-template", "llama3_json_tools"
    ) as server:
        yield server


@pytest.fixture(params=["disagg", "colocated"])
def server(request, disagg_server, tools_server):
    return disagg_server if request.param == "disagg" else tools_server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def assert_no_blocks_held(server) -> None:
    """Every request ended on its workers (an abort after a client error lands shortly)."""

    def idle():
        workers = httpx.get(server.url + "/health", timeout=30).json()["workers"].values()
        return all(w["running"] == 0 and w["integrity_error"] is None for w in workers)

    wait_until(idle, 60, "every worker idle with its blocks intact")


def test_n_shares_the_prompt_and_disagg_transfers_its_kv_once(disagg_server):
    c = client(disagg_server)
    prompt = PROMPT + " and the capital of Germany is"
    one = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    remote = metric(disagg_server.url, 'pdserve_prefill_decisions_total{where="remote"}')
    prefix = "Q: name three colours. A:" * 8  # > one block, not cached yet
    r = c.completions.create(model=MODEL, prompt=prefix, max_tokens=8, temperature=0, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert len({ch.text for ch in r.choices}) == 1  # greedy: the same three times
    assert r.usage.completion_tokens == 3 * 8
    # one remote prefill (one KV transfer); the other two used the KV on the decode worker
    assert (
        metric(disagg_server.url, 'pdserve_prefill_decisions_total{where="remote"}') == remote + 1
    )
    again = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, n=2)
    assert all(ch.text == one.choices[0].text for ch in again.choices)


def test_n_with_a_seed_gives_different_choices_reproducibly(server):
    c = client(server)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=3)
    first = [ch.text for ch in c.completions.create(**kw).choices]
    second = [ch.text for ch in c.completions.create(**kw).choices]
    assert first == second and len(set(first)) > 1


def test_n_streams_every_choice_to_its_end(server):
    chunks = client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=6,
        temperature=0,
        n=2,
        stream=True,
    )
    text, finish = {0: "", 1: ""}, {}
    for ch in chunks:
        for choice in ch.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert text[0] and text[0] == text[1] and set(finish) == {0, 1}


def test_a_client_that_leaves_an_n_stream_frees_every_choice(server):
    body = {"prompt": PROMPT, "max_tokens": 200, "n": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
            if len(seen) == 3:
                break  # every choice is streaming: hang up
    assert seen == {0, 1, 2}
    assert_no_blocks_held(server)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_with_top_logprobs(server, stream):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    c = client(server)
    if stream:
        entries = [
            e
            for ch in c.chat.completions.create(stream=True, **kw)
            for choice in ch.choices
            if choice.logprobs
            for e in choice.logprobs.content
        ]
    else:
        entries = c.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(entries) == 6
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.token == e.top_logprobs[0].token  # greedy picks the most likely token
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert bytes(e.bytes).decode(errors="replace") == e.token


def test_echo_with_logprobs_and_no_output_is_what_lm_eval_asks(server, disagg_server):
    """lm-evaluation-harness's loglikelihood request: the prompt's logprobs only."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    r = client(server).completions.create(**kw)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:]) and len(lp.tokens) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert r.usage.completion_tokens == 0
    # the same numbers whichever pool computed them (disagg: the prefill worker)
    ref = client(disagg_server).completions.create(**kw).choices[0].logprobs
    assert lp.token_logprobs[1:] == pytest.approx(ref.token_logprobs[1:], abs=1e-3)


def test_echo_streams_the_prompt_first(server):
    chunks = client(server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, temperature=0, stream=True
    )
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert texts[0].startswith(PROMPT) and len("".join(texts)) > len(PROMPT)


def test_penalties_and_logit_bias_change_the_output(server):
    c = client(server)
    kw = dict(model=MODEL, prompt="one one one one one", max_tokens=12, temperature=0)
    plain = c.completions.create(**kw).choices[0].text
    penalized = (
        c.completions.create(frequency_penalty=1.5, presence_penalty=1.0, **kw).choices[0].text
    )
    assert penalized != plain
    assert penalized.count(" one") < plain.count(" one") or " one" not in plain
    rep = c.completions.create(extra_body={"repetition_penalty": 1.8}, **kw).choices[0].text
    assert rep != plain
    tok = httpx.post(server.url + "/tokenize", json={"prompt": " Paris"}, timeout=30).json()
    forced = c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
        logit_bias={str(tok["tokens"][0]): 100},
    )  # fmt: skip
    assert forced.choices[0].text == " Paris" * 3


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_json_schema_output_validates(server, stream, temperature):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        max_tokens=60,
        temperature=temperature,
        seed=1,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": SCHEMA},
        },
    )
    c = client(server)
    if stream:
        text = "".join(
            ch.choices[0].delta.content or ""
            for ch in c.chat.completions.create(stream=True, **kw)
            if ch.choices
        )
    else:
        r = c.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_regex(server):
    c = client(server)
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Return a JSON object: a person's name and age."}],
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    pattern = r"[A-Z][a-z]{2,8} is \d{1,3} years old\."
    r = c.completions.create(
        model=MODEL,
        prompt="Tell me about someone.",
        max_tokens=30,
        temperature=0,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, r.choices[0].text)


def test_bad_structured_output_requests_get_400_naming_the_field(disagg_server):
    c = client(disagg_server)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], response_format=bad_schema
        )
    with pytest.raises(openai.BadRequestError, match="regex"):
        c.completions.create(
            model=MODEL, prompt="x", extra_body={"structured_outputs": {"regex": "(unclosed"}}
        )


def tool_calls(server, stream: bool, **kw):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=60,
        temperature=0,
        tools=[WEATHER, TIME],
        **kw,
    )
    c = client(server)
    if not stream:
        choice = c.chat.completions.create(**kw).choices[0]
        calls = [
            (t.id, t.function.name, t.function.arguments) for t in choice.message.tool_calls or ()
        ]
        return calls, choice.finish_reason, choice.message.content
    calls, finish, content = [], None, ""
    for ch in c.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            content += choice.delta.content or ""
            for t in choice.delta.tool_calls or ():
                calls.append((t.id, t.function.name, t.function.arguments))
            finish = choice.finish_reason or finish
    return calls, finish, content or None


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_return_valid_tool_calls(tools_server, stream):
    calls, finish, content = tool_calls(tools_server, stream, tool_choice="required")
    assert finish == "tool_calls" and content is None and calls
    call_id, name, arguments = calls[0]
    assert call_id.startswith("call_") and name in ("get_weather", "get_time")
    schema = (WEATHER if name == "get_weather" else TIME)["function"]["parameters"]
    jsonschema.validate(json.loads(arguments), schema)
    named = {"type": "function", "function": {"name": "get_time"}}
    calls, finish, _ = tool_calls(tools_server, stream, tool_choice=named)
    assert finish == "tool_calls" and [c[1] for c in calls] == ["get_time"]
    assert json.loads(calls[0][2])["zone"] in ("UTC", "CET")


def test_tool_choice_auto_and_none(tools_server):
    calls, finish, content = tool_calls(tools_server, False, tool_choice="auto")
    assert (finish == "tool_calls") == bool(calls) and (content is None) == bool(calls)
    calls, finish, content = tool_calls(tools_server, False, tool_choice="none")
    assert calls == [] and content and finish in ("stop", "length")


def test_tools_without_a_tool_template_and_bad_tools_get_400(disagg_server, tools_server):
    c = client(disagg_server)  # SmolLM2's own template renders no tools
    with pytest.raises(openai.BadRequestError, match="--chat-template"):
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[WEATHER]
        )
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client(tools_server).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


def test_tokenize_and_detokenize_as_vllm_and_llama_cpp_shape_them(server):
    url = server.url
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}, timeout=30).json()
    assert r["count"] == len(r["tokens"]) == 5 and r["max_model_len"] == 8192
    cpp = httpx.post(url + "/tokenize", json={"content": PROMPT}, timeout=30).json()
    assert cpp["tokens"] == r["tokens"]
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back["prompt"] == back["content"] == PROMPT
    chat = httpx.post(
        url + "/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True},
        timeout=30,
    ).json()
    assert chat["count"] > 5 and len(chat["token_strs"]) == chat["count"]
    bad = httpx.post(url + "/detokenize", json={"tokens": [-1]}, timeout=30)
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]
    assert httpx.post(url + "/tokenize", json={"text": "x"}, timeout=30).status_code == 400


def test_nothing_is_left_held(server):
    assert_no_blocks_held(server)
