"""A request's prompt, conversation, stop strings and logit bias, in the types the router
passes on; a malformed one is an APIError(400) naming the field."""

from __future__ import annotations

import msgspec

from pdserve.router.openai_api.errors import APIError
from pdserve.router.openai_api.schemas import ChatRequest, CompletionRequest, SamplingFields


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
