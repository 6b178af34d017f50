"""OpenAI request schemas, validation into clear 4xx errors, and response/chunk builders."""

from __future__ import annotations

import json
import time
import uuid

import msgspec

from pdserve.engine.guided import GuideSpec, check_spec
from pdserve.router.tools import Tool, ToolCall, ToolChoice

MAX_BODY_BYTES = 8 << 20  # checked as the body is read (Frontend.read_body)
MAX_N = 16  # choices per request
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)


class APIError(Exception):
    """Becomes an OpenAI-style error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = "invalid_request_error" if status < 500 else "server_error"

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


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


def parse(body: bytes, kind: type):
    """Decode and validate a request body (read within MAX_BODY_BYTES); APIError(400) saying
    what to change otherwise."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("`$.", 1)[-1].rstrip("`") if "`$." in text else None
        if text.startswith("Object contains unknown field"):
            name = text.split("`")[1]
            raise APIError(
                400,
                f"unknown field {name!r}{f' in {param}' if param else ''}: pdserve does not "
                "support it (it would be ignored); remove it",
                param=name,
            ) from None
        raise APIError(400, f"invalid request: {exc}", param=param) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the body is not valid JSON ({exc}); send a JSON object") from None
    except RecursionError:
        raise APIError(400, "the JSON is nested too deeply; send a flat request object") from None
    except UnicodeDecodeError:
        raise APIError(400, "the body is not valid UTF-8; send UTF-8 encoded JSON") from None
    _check_unsupported(req)
    _check_request(req)
    return req


# Fields of OpenAI's request schemas that pdserve knows but cannot honour: refused when set to
# anything but what pdserve does anyway. {field: (allowed values, what to do instead)}
UNSUPPORTED = {
    "suffix": ((None,), "insertion (suffix) is not supported; send the prompt only"),
    "service_tier": ((None, "auto", "default"), "there is one service tier here; leave it unset"),
    "store": ((None, False), "completions are not stored here; leave store unset"),
    "metadata": ((None,), "metadata is only for stored completions; leave it unset"),
    "prediction": ((None,), "predicted outputs are not supported; leave prediction unset"),
    "audio": ((None,), "audio output is not supported; this model answers in text"),
    "modalities": ((None, ["text"]), "only text output is supported: modalities=['text']"),
    "reasoning_effort": ((None,), "this model does not reason; leave reasoning_effort unset"),
    "verbosity": ((None,), "verbosity is not supported; leave it unset"),
    "web_search_options": ((None,), "web search is not supported; leave it unset"),
    "functions": ((None,), "functions is deprecated and not supported; use tools"),
    "function_call": ((None,), "function_call is deprecated and not supported; use tool_choice"),
    "parallel_tool_calls": (
        (None, True),
        "parallel_tool_calls=false is not supported; the model may return several calls",
    ),
}


def _check_unsupported(req) -> None:
    if not isinstance(req, SamplingFields):
        return
    for name, (allowed, message) in UNSUPPORTED.items():
        if getattr(req, name) not in allowed:
            raise APIError(400, message, param=name)
    if req.best_of not in (None, 1, req.n):  # best_of = n is n
        raise APIError(
            400,
            "best_of other than n is not supported; use n and pick the best yourself",
            param="best_of",
        )


def _check_request(req) -> None:
    """The rules of the OpenAI request itself; the sampling parameters' ranges are checked when
    they are made (SamplingParams, router/plans.py)."""
    if not isinstance(req, SamplingFields):
        return
    chat = isinstance(req, ChatRequest)
    checks = [
        (not 1 <= req.n <= MAX_N, "n", f"n must be in [1, {MAX_N}]"),
        (
            req.max_tokens is not None
            and req.max_tokens < (0 if getattr(req, "echo", False) else 1),
            "max_tokens",
            "max_tokens must be >= 1 (0 only with echo=true)",
        ),
        (
            (getattr(req, "max_completion_tokens", None) or 1) < 1,
            "max_completion_tokens",
            "max_completion_tokens must be >= 1",
        ),
        (abs(req.priority) >= 2**31, "priority", "priority must be in (-2^31, 2^31)"),
        (
            req.max_tokens is not None and req.max_tokens >= 2**31,
            "max_tokens",
            "max_tokens must be < 2^31",
        ),
        (
            chat and req.top_logprobs is not None and not req.logprobs,
            "top_logprobs",
            "top_logprobs needs logprobs=true",
        ),
        (
            len(stop_list(req)) > MAX_STOPS,
            "stop",
            f"stop takes up to {MAX_STOPS} non-empty strings",
        ),
    ]
    for bad, param, message in checks:
        if bad:
            raise APIError(400, message, param=param)


def logit_bias_of(req: SamplingFields, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; 400 for a key that is not a token id
    (SamplingParams checks the biases)."""
    out = []
    for key, bias in (req.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise APIError(
                400,
                f"logit_bias keys are token ids in [0, {vocab_size}) as strings; got {key!r}",
                param="logit_bias",
            )
        out.append((int(key), float(bias)))
    return tuple(out)


def guide_of(req: SamplingFields) -> GuideSpec | None:
    """The output constraint a request asks for (response_format, structured_outputs, or the
    guided_* extensions; at most one), compiled once to refuse a bad one with a 400."""
    asked = []
    rf = req.response_format
    if rf is not None:
        if rf.type == "json_object":
            asked.append(("response_format", GuideSpec("json_object")))
        elif rf.type == "json_schema":
            schema = (rf.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError(
                    400,
                    "response_format json_schema needs json_schema.schema: a JSON schema object",
                    param="response_format",
                )
            asked.append(("response_format", GuideSpec("json_schema", json.dumps(schema))))
        elif rf.type != "text":
            raise APIError(
                400,
                f"response_format type {rf.type!r} is not supported; use text, json_object or "
                "json_schema",
                param="response_format",
            )
    so = req.structured_outputs
    if so is not None:
        given = [k for k in ("json", "json_object", "regex", "grammar") if getattr(so, k)]
        if len(given) != 1:
            raise APIError(
                400,
                "structured_outputs takes exactly one of json, json_object, regex, grammar",
                param="structured_outputs",
            )
        asked.append(("structured_outputs", _spec(given[0], getattr(so, given[0]))))
    for kind in ("json", "regex", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            asked.append((f"guided_{kind}", _spec(kind, value)))
    if len(asked) > 1:
        raise APIError(
            400,
            f"{asked[0][0]} and {asked[1][0]} both constrain the output; send one",
            param=asked[1][0],
        )
    if not asked:
        return None
    param, spec = asked[0]
    try:
        check_spec(spec)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from None
    return spec


def _spec(kind: str, value) -> GuideSpec:
    if kind == "json_object":
        return GuideSpec("json_object")
    if kind == "json":
        return GuideSpec("json_schema", value if isinstance(value, str) else json.dumps(value))
    return GuideSpec(kind, value)


def stop_list(req: SamplingFields) -> tuple[str, ...]:
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())


def prompt_of(req: CompletionRequest) -> str | list[int]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise APIError(
                400,
                "batched prompts are not supported; send one prompt per request",
                param="prompt",
            )
        p = p[0]
    if not p:
        raise APIError(400, "prompt is empty: give at least one token of text", param="prompt")
    if isinstance(p, list) and not all(type(t) is int for t in p):
        raise APIError(
            400, "prompt must be a string or a list of token ids (integers)", param="prompt"
        )
    return p


def messages_of(req: ChatRequest) -> list[dict]:
    """The conversation as the chat template takes it (tool calls and results included)."""
    if not req.messages:
        raise APIError(400, "messages is empty: send at least one message", param="messages")
    out = []
    for i, msg in enumerate(req.messages):
        if msg.role not in ("system", "user", "assistant", "tool", "developer"):
            raise APIError(400, f"unknown message role {msg.role!r}", param=f"messages[{i}]")
        content = msg.content or ""
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError(
                    400,
                    "this model reads text only: send content parts of type 'text'",
                    param=f"messages[{i}].content",
                )
            content = "".join(part.text or "" for part in content)
        item = {"role": msg.role, "content": content}
        if msg.name is not None:
            item["name"] = msg.name
        if msg.tool_calls:
            item["tool_calls"] = msgspec.to_builtins(msg.tool_calls)
        if msg.tool_call_id is not None:
            item["tool_call_id"] = msg.tool_call_id
        out.append(item)
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(rid, model, choices: list[dict], use, chat: bool) -> dict:
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def chunk_body(rid, model, choices: list[dict], chat: bool, use: dict | None = None) -> dict:
    body = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        body["usage"] = use
    return body


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else msgspec.json.encode(obj).decode()
    return f"data: {data}\n\n".encode()
