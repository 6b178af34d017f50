"""A parsed OpenAI request made into a Plan: the prompt's token ids, its SamplingParams (the one
sampling type, protocol/sampling.py, which validates them) and how to shape the answer. One
function per endpoint: `completion_plan`, `chat_plan`; `sampling_params` maps the fields both
endpoints share, so adding a knob is its schema field, a line there, and the sampler."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.guided import GuideSpec
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import SamplingError, SamplingParams
from pdserve.router.openai_api import fields
from pdserve.router.openai_api.errors import APIError
from pdserve.router.openai_api.guides import guide_of
from pdserve.router.openai_api.schemas import ChatRequest, CompletionRequest, SamplingFields


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A validated request: what to submit (n times) and how to shape the answer."""

    ids: list[int]
    params: SamplingParams  # its stop strings are applied by the router (engine/stops.py)
    n: int
    chat: bool
    want_logprobs: bool
    tools: bool  # the answer may be a tool call: parse it
    echo: str | None  # completions with echo: the prompt's text
    keep_output: bool  # False: max_tokens=0 with echo, the prompt alone is the answer


def completion_plan(req: CompletionRequest, tok: Tokenizer, window: int) -> Plan:
    """/v1/completions: a prompt (text or token ids), optionally echoed with its logprobs."""
    prompt = fields.prompt_of(req)
    ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
    check_token_ids(ids, "prompt", tok.vocab_size)
    check_window(ids, window)
    echo = None
    if req.echo:
        echo = prompt if isinstance(prompt, str) else tok.decode(ids)
    want_logprobs, k = req.logprobs is not None, req.logprobs or 0
    asked = 16 if req.max_tokens is None else req.max_tokens
    params = sampling_params(
        req,
        tok.vocab_size,
        max_tokens=output_budget(asked, ids, window),
        logprobs=k if want_logprobs else None,
        prompt_logprobs=k if want_logprobs and echo is not None else None,
        guide=guide_of(req),
    )
    return Plan(
        ids=ids, params=params, n=req.n, chat=False, want_logprobs=want_logprobs, tools=False,
        echo=echo, keep_output=asked != 0,  # 0: completions with echo, the prompt's logprobs only
    )  # fmt: skip


def chat_plan(
    req: ChatRequest, ids: list[int], tools_on: bool, tool_guide: GuideSpec | None,
    vocab_size: int, window: int,
) -> Plan:  # fmt: skip
    """/v1/chat/completions, its conversation rendered into `ids` (`tools_on`: the answer may
    be a tool call; `tool_guide`: tool_choice required or named forces one)."""
    check_window(ids, window)
    guide = guide_of(req)
    if tool_guide is not None and guide is not None:
        raise APIError(
            400,
            "tool_choice required or named constrains the output, and so does "
            "response_format; send one of them",
            param="tool_choice",
        )
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    want_logprobs = bool(req.logprobs)
    params = sampling_params(
        req,
        vocab_size,
        max_tokens=output_budget(asked, ids, window),
        logprobs=(req.top_logprobs or 0) if want_logprobs else None,
        guide=guide or tool_guide,
        renamed={"logprobs": "top_logprobs"},
    )
    return Plan(
        ids=ids, params=params, n=req.n, chat=True, want_logprobs=want_logprobs, tools=tools_on,
        echo=None, keep_output=True,
    )  # fmt: skip


def sampling_params(
    req: SamplingFields, vocab_size: int, renamed: dict[str, str] | None = None, **endpoint
) -> SamplingParams:
    """The request's SamplingParams: the fields both endpoints share, and `endpoint`'s own
    (max_tokens, logprobs, ...). An out-of-range value is a 400 naming the request's field
    (`renamed`: the endpoint's name for a SamplingParams field)."""
    check_token_ids(req.stop_token_ids or (), "stop_token_ids", vocab_size)
    try:
        return SamplingParams(
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            stop=fields.stop_list(req),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=fields.logit_bias_of(req, vocab_size),
            **endpoint,
        )
    except SamplingError as exc:
        param = (renamed or {}).get(exc.param, exc.param)
        raise APIError(400, f"{param} {exc.rule}", param=param) from None


def output_budget(asked: int | None, ids: list[int], window: int) -> int:
    """Tokens the answer may have: what was asked (None or 0: as many as fit), within the
    context window."""
    room = window - len(ids)
    return min(asked or room, room)


def check_window(ids: list[int], window: int) -> None:
    if len(ids) >= window:
        raise APIError(
            400,
            f"the prompt has {len(ids)} tokens but the context window is {window}: "
            f"shorten it to at most {window - 1} tokens",
            param="prompt",
            code="context_length_exceeded",
        )


def check_token_ids(ids, param: str, vocab_size: int) -> None:
    if any(not 0 <= t < vocab_size for t in ids):
        raise APIError(400, f"{param} must be token ids in [0, {vocab_size})", param=param)
