"""Reading and checking a request body: within MAX_BODY_BYTES, decoded into its schema, the
OpenAI fields pdserve cannot honour refused, and the request's own rules (n, max_tokens, ...);
each failure an APIError that says what to change. The sampling parameters' ranges are checked
when they are made (SamplingParams, via plans.py)."""

from __future__ import annotations

import msgspec
from starlette.requests import Request

from pdserve.router.openai_api.errors import APIError
from pdserve.router.openai_api.fields import stop_list
from pdserve.router.openai_api.schemas import ChatRequest, SamplingFields

MAX_BODY_BYTES = 8 << 20  # checked as the body is read (read_body)
MAX_N = 16  # choices per request
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)


async def read_body(request: Request) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed the limit (a declared
    Content-Length is checked before anything is read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(
            413, f"request body of {declared} bytes exceeds the {MAX_BODY_BYTES}-byte limit"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"request body exceeds the {MAX_BODY_BYTES}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


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
    they are made (SamplingParams, in plans.py)."""
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
