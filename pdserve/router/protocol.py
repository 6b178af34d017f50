"""OpenAI request schemas, validation into clear 4xx errors, and response/chunk builders."""

from __future__ import annotations

import time
import uuid

import msgspec

MAX_BODY_BYTES = 8 << 20


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


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
    user: str | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[int | str | list[int]]  # text, token ids, or a batch of one
    echo: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def parse(body: bytes, kind: type):
    """Decode and validate a request body; APIError(400) saying what to change otherwise."""
    if len(body) > MAX_BODY_BYTES:
        raise APIError(413, f"request body is {len(body)} bytes; the limit is {MAX_BODY_BYTES}")
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        param = str(exc).rsplit("`$.", 1)[-1].rstrip("`") if "`$." in str(exc) else None
        raise APIError(400, f"invalid request: {exc}", param=param) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the body is not valid JSON ({exc}); send a JSON object") from None
    except RecursionError:
        raise APIError(400, "the JSON is nested too deeply; send a flat request object") from None
    except UnicodeDecodeError:
        raise APIError(400, "the body is not valid UTF-8; send UTF-8 encoded JSON") from None
    _check_sampling(req)
    return req


def _check_sampling(req: _Sampling) -> None:
    checks = [
        (req.n != 1, "n", "only n=1 is supported; send one request per completion"),
        (
            req.max_tokens is not None and req.max_tokens < 1,
            "max_tokens",
            "max_tokens must be >= 1",
        ),
        (
            (getattr(req, "max_completion_tokens", None) or 1) < 1,
            "max_completion_tokens",
            "max_completion_tokens must be >= 1",
        ),
        (not 0 <= req.temperature <= 2, "temperature", "temperature must be between 0 and 2"),
        (not 0 < req.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
        (not 0 <= req.top_k < 2**31, "top_k", "top_k must be in [0, 2^31) (0 = off)"),
        (req.seed is not None and not 0 <= req.seed < 2**63, "seed", "seed must be in [0, 2^63)"),
        (
            req.max_tokens is not None and req.max_tokens >= 2**31,
            "max_tokens",
            "max_tokens must be < 2^31",
        ),
        (
            req.presence_penalty != 0 or req.frequency_penalty != 0,
            "presence_penalty",
            "presence/frequency penalties are not supported; leave them at 0",
        ),
        (bool(req.logprobs), "logprobs", "logprobs are not supported; leave logprobs unset"),
        (
            getattr(req, "echo", False),
            "echo",
            "echo is not supported; leave it false and prepend the prompt yourself",
        ),
    ]
    for bad, param, message in checks:
        if bad:
            raise APIError(400, message, param=param)
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise APIError(400, "stop takes up to 4 non-empty strings", param="stop")


def stop_list(req: _Sampling) -> tuple[str, ...]:
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
    if not req.messages:
        raise APIError(400, "messages is empty: send at least one message", param="messages")
    out = []
    for msg in req.messages:
        if msg.role not in ("system", "user", "assistant", "tool", "developer"):
            raise APIError(400, f"unknown message role {msg.role!r}", param="messages")
        content = msg.content or ""
        if isinstance(content, list):
            content = "".join(p.text or "" for p in content if p.type == "text")
        out.append({"role": msg.role, "content": content})
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(rid, model, text, finish, use, chat: bool) -> dict:
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "logprobs": None,
        }
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chunk_body(rid, model, text, finish, chat: bool, first: bool = False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def usage_chunk(rid, model, use, chat: bool) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": use,
    }


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else msgspec.json.encode(obj).decode()
    return f"data: {data}\n\n".encode()
