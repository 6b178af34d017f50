"""The OpenAI request bodies the router takes, as msgspec structs: a field pdserve does not know
is refused (400 naming it), never accepted and ignored."""

from __future__ import annotations

import msgspec

from pdserve.router.tools import Tool, ToolCall, ToolChoice


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A field we do not know is refused (400 naming it), never accepted and ignored."""


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    """`text`, `json_object`, or `json_schema` with `{"name", "schema", "strict"}`."""

    type: str
    json_schema: dict | None = None


class StructuredOutputs(_Strict):
    """vLLM's extension: exactly one of json (a schema), json_object, regex, grammar (Lark)."""

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None


class SamplingFields(_Strict):
    """The fields both generation endpoints take; their ranges are SamplingParams' own."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension (vLLM): 0 = off
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    seed: int | None = None
    ignore_eos: bool = False  # extension (vLLM)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (vLLM)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # the tenant when no API key or X-Tenant header says (fairness)
    priority: int = 0  # extension (vLLM): under overload, lower values are admitted first
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None  # older vLLM names of structured_outputs
    guided_regex: str | None = None
    guided_grammar: str | None = None
    # OpenAI fields that pdserve cannot honour: refused with a 400 that says so when set
    suffix: str | None = None
    best_of: int | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    prediction: dict | None = None
    audio: dict | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[int | str | list[int]]  # text, token ids, or a batch of one
    echo: bool = False
    logprobs: int | None = None  # the chosen token's and this many top logprobs (0..20)


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class TokenizeRequest(_Strict):
    """POST /tokenize: vLLM's `prompt` or `messages`, or llama.cpp's `content`."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[Tool] | None = None


class DetokenizeRequest(_Strict):
    tokens: list[int]
    model: str | None = None
