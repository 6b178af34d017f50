"""An OpenAI request made into a Plan: its SamplingParams, and a 400 naming the request's field
when a value is out of range."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.router.openai_api.errors import APIError
from pdserve.router.openai_api.plans import chat_plan, completion_plan
from pdserve.router.openai_api.schemas import ChatRequest, CompletionRequest
from pdserve.router.openai_api.validation import parse


class Tok:
    vocab_size = 100

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)


def completion(**fields) -> CompletionRequest:
    return parse(msgspec.json.encode({"prompt": "hello", **fields}), CompletionRequest)


def chat(**fields) -> ChatRequest:
    messages = [{"role": "user", "content": "hi"}]
    return parse(msgspec.json.encode({"messages": messages, **fields}), ChatRequest)


def test_completion_plan_maps_the_request():
    plan = completion_plan(completion(stop="x", seed=3, logprobs=2, echo=True), Tok(), 64)
    assert plan.ids == Tok().encode("hello") and plan.echo == "hello"
    assert plan.params.stop == ("x",) and plan.params.seed == 3 and plan.params.max_tokens == 16
    assert (plan.params.logprobs, plan.params.prompt_logprobs) == (2, 2)
    assert plan.want_logprobs and plan.keep_output and not plan.chat


def test_max_tokens_zero_with_echo_asks_for_the_rest_of_the_window_and_keeps_no_output():
    plan = completion_plan(completion(max_tokens=0, echo=True), Tok(), 64)
    assert plan.params.max_tokens == 64 - 5 and not plan.keep_output


def test_chat_plan_maps_top_logprobs():
    plan = chat_plan(chat(logprobs=True, top_logprobs=3), [1, 2, 3], False, None, 100, 64)
    assert plan.params.logprobs == 3 and plan.params.prompt_logprobs is None and plan.chat
    assert plan.params.max_tokens == 61  # the rest of the window


@pytest.mark.parametrize(
    ("make", "fields", "param", "message"),
    [
        (completion, {"temperature": 3}, "temperature", "temperature must be >= 0"),
        (completion, {"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
        (completion, {"logprobs": 21}, "logprobs", "logprobs must be in [0, 20]"),
        (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be in"),
        (completion, {"logit_bias": {"5": 300}}, "logit_bias", "values must be in [-100, 100]"),
        (completion, {"stop_token_ids": [100]}, "stop_token_ids", "token ids in [0, 100)"),
        (completion, {"seed": -1}, "seed", "seed must be in [0, 2^63)"),
    ],
)
def test_a_bad_value_is_a_400_naming_the_field(make, fields, param, message):
    with pytest.raises(APIError) as caught:
        if make is completion:
            completion_plan(make(**fields), Tok(), 64)
        else:
            chat_plan(make(**fields), [1], False, None, 100, 64)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert message in caught.value.message


def test_a_prompt_over_the_window_is_refused():
    with pytest.raises(APIError, match="context window is 4"):
        completion_plan(completion(), Tok(), 4)
