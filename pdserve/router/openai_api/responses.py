"""The bodies of answers: ids, usage, a whole completion, an SSE chunk."""

from __future__ import annotations

import time
import uuid

import msgspec


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
