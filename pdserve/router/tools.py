"""OpenAI tool calling for models that call tools in the Llama-3 JSON format.

The format is vLLM's `llama3_json`: the model answers a call with one JSON object
`{"name": ..., "parameters": {...}}` (or several joined by `;`), optionally after
`<|python_tag|>`. A chat request with tools goes through:

1. decode: `tools: list[Tool]`, `tool_choice: ToolChoice`; `check_tools` refuses bad ones (400).
2. render: the chat template gets `tools_for_template(tools)` (`Tokenizer.render_chat(tools=)`);
   the model's template must use them (`template_supports_tools`), else a tool template is
   given (`pdserve/model/templates/llama3_json_tools.jinja`).
3. constrain: for "required" or a named tool, `tool_call_schema` is the JSON schema the output
   is held to; "auto" decodes freely.
4. parse: `parse_tool_calls` turns the finished text into OpenAI `tool_calls` (or leaves it
   content); while streaming, text is held back as long as `might_be_tool_call` says so.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

import jinja2
import msgspec
from jinja2 import meta

PYTHON_TAG = "<|python_tag|>"


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A function the model may call; `parameters` is a JSON schema of type object."""

    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: str  # only "function"; checked by check_tools so the error can say so
    function: FunctionDef


class ToolChoiceFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    """`{"type": "function", "function": {"name": ...}}`: call exactly this tool."""

    type: str
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)


class ToolCall(msgspec.Struct):
    """A call in an assistant message the client sends back (unknown keys such as a streamed
    `index` are ignored)."""

    id: str
    function: FunctionCall
    type: str = "function"


class ToolError(ValueError):
    """A bad `tools` or `tool_choice`; `param` names which (for the HTTP 400 body)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> None:
    """Raise ToolError saying what to change when `tools`/`tool_choice` cannot be served.

    An empty `tools` list counts as no tools (some clients always send one).
    """
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if tool.type != "function":
            raise ToolError(f"{where}.type is {tool.type!r}: only 'function' tools exist", "tools")
        name = tool.function.name
        if not name or len(name) > 64:
            raise ToolError(f"{where}.function.name must have 1 to 64 characters", "tools")
        if name in names:
            raise ToolError(f"two tools are named {name!r}: tool names must be unique", "tools")
        names.add(name)
        _check_parameters(tool.function.parameters, f"{where}.function.parameters")
    if tool_choice is None or tool_choice == "none":
        return
    if not names:
        raise ToolError(
            f"tool_choice {_choice_str(tool_choice)} needs tools: send tools or leave "
            "tool_choice unset",
            "tool_choice",
        )
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required"):
            raise ToolError(
                f"tool_choice {tool_choice!r} is unknown: use 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
    elif tool_choice.type != "function":
        raise ToolError(f"tool_choice.type is {tool_choice.type!r}: use 'function'", "tool_choice")
    elif tool_choice.function.name not in names:
        raise ToolError(
            f"tool_choice names {tool_choice.function.name!r}, which is not in tools "
            f"({', '.join(sorted(names))})",
            "tool_choice",
        )


def _check_parameters(schema: dict | None, where: str) -> None:
    if schema is None:
        return
    if schema.get("type", "object") != "object":
        raise ToolError(f"{where}.type must be 'object' (a JSON schema of the arguments)", "tools")
    if not isinstance(schema.get("properties", {}), dict):
        raise ToolError(f"{where}.properties must be an object of property schemas", "tools")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ToolError(f"{where}.required must be a list of property names", "tools")


def _choice_str(choice: ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming {choice.function.name!r}"


def tools_for_template(tools: list[Tool]) -> list[dict]:
    """The tools as plain dicts in OpenAI's shape (unset fields left out), for the template."""
    return msgspec.to_builtins(tools)


def tool_call_schema(tools: list[Tool], tool_choice: ToolChoice | None) -> dict | None:
    """The JSON schema of a Llama-3 JSON call the output must match, or None when the output
    is free ("auto", "none", unset). "required" allows any of the tools (anyOf), a named
    tool_choice only that one. Assumes check_tools passed."""
    if tool_choice is None or (isinstance(tool_choice, str) and tool_choice != "required"):
        return None
    if isinstance(tool_choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == tool_choice.function.name]
    calls = [_call_schema(t.function) for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _call_schema(fn: FunctionDef) -> dict:
    # no parameters means the function takes none (OpenAI), so only {} is allowed
    params = fn.parameters or {"type": "object", "properties": {}, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "const": fn.name}, "parameters": params},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished answer: (None, calls) when the whole text is one or
    more Llama-3 JSON calls, else (text, []). Calls are OpenAI `tool_calls` entries whose
    `function.arguments` is a JSON string."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return text, []
    decoder, pos, calls = json.JSONDecoder(), 0, []
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        call = _call_of(obj)
        if call is None:
            return text, []
        calls.append(call)
        rest = body[pos:].lstrip()
        if rest and not rest.startswith(";"):
            return text, []  # text after the JSON: an answer that happens to start with {
        pos = len(body) - len(rest.lstrip(";").lstrip())
    return None, calls


def _call_of(obj) -> dict | None:
    """One OpenAI tool call from a parsed `{"name", "parameters"|"arguments"}`, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def might_be_tool_call(prefix: str) -> bool:
    """Whether streamed text so far could still become a tool call, so it must be held back:
    nothing but whitespace yet, or it starts with `{`, or with (a prefix of) `<|python_tag|>`
    followed by nothing or `{`. Once False, it stays False for every longer prefix."""
    head = prefix.lstrip()
    if head.startswith(PYTHON_TAG):
        head = head[len(PYTHON_TAG) :].lstrip()
        return not head or head.startswith("{")
    return not head or head.startswith("{") or PYTHON_TAG.startswith(head)


def template_supports_tools(template: str | None) -> bool:
    """Whether a Jinja chat template reads the `tools` variable (False if it does not parse)."""
    if not template:
        return False
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in meta.find_undeclared_variables(ast)
