"""Tool calling pieces: request checks, the constraining schema, the Llama-3 JSON call parser,
the streaming hold-back test, and the shipped tool chat template."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from pdserve.model.tokenizer import Tokenizer, load_chat_template
from pdserve.router.tools import (
    NamedToolChoice,
    Tool,
    ToolChoice,
    ToolError,
    check_tools,
    might_be_tool_call,
    parse_tool_calls,
    template_supports_tools,
    tool_call_schema,
    tools_for_template,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"],
}


def make_tool(name: str, parameters: dict | None = WEATHER, type: str = "function") -> Tool:
    fn = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return msgspec.convert({"type": type, "function": fn}, Tool)


def choice(value) -> ToolChoice:
    return msgspec.convert(value, ToolChoice)


def make_tokenizer(folder: Path, template: str | None = None) -> Tokenizer:
    """A one-word tokenizer (rendering never looks at its vocabulary) with `template`."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    HFTokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(folder)


# -- request shapes and checks --


def test_structs_refuse_unknown_keys_and_choices():
    with pytest.raises(msgspec.ValidationError, match="Object contains unknown field `foo`"):
        msgspec.convert({"type": "function", "function": {"name": "f", "foo": 1}}, Tool)
    with pytest.raises(msgspec.ValidationError):
        choice("sometimes")
    assert choice("auto") == "auto"
    named = choice({"type": "function", "function": {"name": "f"}})
    assert isinstance(named, NamedToolChoice) and named.function.name == "f"


@pytest.mark.parametrize(
    "tools, tool_choice, param, message",
    [
        ([make_tool("f", type="code_interpreter")], None, "tools", "only 'function' tools"),
        ([make_tool("")], None, "tools", "1 to 64 characters"),
        ([make_tool("f"), make_tool("f")], None, "tools", "two tools are named 'f'"),
        ([make_tool("f", {"type": "string"})], None, "tools", "parameters.type must be 'object'"),
        ([make_tool("f", {"properties": []})], None, "tools", "properties must be an object"),
        ([make_tool("f", {"required": "city"})], None, "tools", "required must be a list"),
        (None, "required", "tool_choice", "tool_choice 'required' needs tools"),
        ([], "auto", "tool_choice", "tool_choice 'auto' needs tools"),
        (None, {"type": "function", "function": {"name": "f"}}, "tool_choice", "naming 'f'"),
        (
            [make_tool("f"), make_tool("g")],
            {"type": "function", "function": {"name": "h"}},
            "tool_choice",
            "names 'h', which is not in tools (f, g)",
        ),
        ([make_tool("f")], {"type": "fn", "function": {"name": "f"}}, "tool_choice", "'fn'"),
    ],
)
def test_check_tools_says_what_is_wrong(tools, tool_choice, param, message):
    tool_choice = None if tool_choice is None else choice(tool_choice)
    with pytest.raises(ToolError, match=re.escape(message)) as info:
        check_tools(tools, tool_choice)
    assert info.value.param == param and isinstance(info.value, ValueError)


def test_check_tools_accepts_valid_requests():
    tools = [make_tool("f"), make_tool("g", None), make_tool("h", {})]
    for tool_choice in (
        None,
        "none",
        "auto",
        "required",
        {"type": "function", "function": {"name": "g"}},
    ):
        check_tools(tools, None if tool_choice is None else choice(tool_choice))
    check_tools(None, choice("none"))
    check_tools([], None)


def test_tools_for_template_leaves_unset_fields_out():
    assert tools_for_template([make_tool("g", None)]) == [
        {"type": "function", "function": {"name": "g"}}
    ]


# -- the schema a forced call must match --


def call_schema(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "const": name}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def test_tool_call_schema_shapes():
    tools = [make_tool("f"), make_tool("g", None)]
    no_args = {"type": "object", "properties": {}, "additionalProperties": False}
    assert tool_call_schema(tools, choice("required")) == {
        "anyOf": [call_schema("f", WEATHER), call_schema("g", no_args)]
    }
    named = choice({"type": "function", "function": {"name": "f"}})
    assert tool_call_schema(tools, named) == call_schema("f", WEATHER)
    assert tool_call_schema(tools[:1], choice("required")) == call_schema("f", WEATHER)
    for free in (None, choice("auto"), choice("none")):
        assert tool_call_schema(tools, free) is None


def test_tool_call_schema_accepts_exactly_the_calls():
    jsonschema = pytest.importorskip("jsonschema")
    schema = tool_call_schema([make_tool("f"), make_tool("g", None)], choice("required"))
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = jsonschema.Draft202012Validator(schema).is_valid
    assert valid({"name": "f", "parameters": {"city": "Paris"}})
    assert valid({"name": "g", "parameters": {}})
    assert not valid({"name": "f", "parameters": {}})  # city is required
    assert not valid({"name": "g", "parameters": {"x": 1}})
    assert not valid({"name": "h", "parameters": {}})
    assert not valid({"name": "f", "parameters": {"city": "Paris"}, "extra": 1})


# -- parsing the answer --


def calls_of(text: str) -> list[tuple[str, dict]]:
    content, calls = parse_tool_calls(text)
    assert content is None
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert len(call["id"]) == len("call_") + 24
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_parse_one_call():
    assert calls_of(' {"name": "f", "parameters": {"city": "Paris"}}\n') == [
        ("f", {"city": "Paris"})
    ]
    assert calls_of('{"name": "f", "arguments": {"n": 1}}') == [("f", {"n": 1})]
    assert calls_of('{"name": "f", "arguments": "{\\"n\\": 2}"}') == [("f", {"n": 2})]


def test_parse_several_calls_and_python_tag():
    text = '<|python_tag|>{"name": "f", "parameters": {"a": {"b": [1]}}}; '
    text += '{"name": "g", "parameters": {}};'
    assert calls_of(text) == [("f", {"a": {"b": [1]}}), ("g", {})]
    _, calls = parse_tool_calls(text)
    assert calls[0]["id"] != calls[1]["id"]


def test_parse_keeps_non_ascii_arguments_readable():
    _, calls = parse_tool_calls('{"name": "f", "parameters": {"city": "Zürich"}}')
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        "",
        '{"name": "f", "parameters": {"city": "Par',  # cut off
        '{"name": "f"}',  # no arguments: JSON content, not a call
        '{"title": "x", "parameters": {}}',
        '{"name": "f", "parameters": [1]}',
        '{"name": "f", "parameters": {}} and then some text',
        '{"name": "f", "parameters": {}}; not json',
        'Sure: {"name": "f", "parameters": {}}',
    ],
)
def test_parse_leaves_other_text_as_content(text):
    assert parse_tool_calls(text) == (text, [])


@pytest.mark.parametrize(
    "prefix, held",
    [
        ("", True),
        ("  \n", True),
        ("{", True),
        (' {"name": "f", "par', True),
        ("<|py", True),
        ("<|python_tag|>", True),
        ("<|python_tag|> {", True),
        ("<", True),
        ("Hello", False),
        ("<|pyx", False),
        ("<|python_tag|>hi", False),
        ("[", False),
    ],
)
def test_might_be_tool_call(prefix, held):
    assert might_be_tool_call(prefix) is held


# -- templates --


def test_template_supports_tools():
    assert template_supports_tools(load_chat_template("llama3_json_tools"))
    assert not template_supports_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_supports_tools("{% set tools = [] %}{{ tools }}")  # its own variable
    assert not template_supports_tools("{% if %}")  # does not parse
    assert not template_supports_tools(None)


@pytest.mark.slow
def test_bundled_model_template_has_no_tools():
    from pdserve.model.loader import load_tokenizer

    assert not template_supports_tools(load_tokenizer(None).chat_template)


def test_load_chat_template_names_the_shipped_ones(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert load_chat_template(str(tmp_path / "t.jinja")) == "{{ messages }}"
    with pytest.raises(FileNotFoundError, match="llama3_json_tools"):
        load_chat_template("nope")


SYSTEM = "<|start_header_id|>system<|end_header_id|>\n\n"
DATES = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
ASSISTANT = "<|start_header_id|>assistant<|end_header_id|>\n\n"
USER = "<|start_header_id|>user<|end_header_id|>\n\n"
IPYTHON = "<|start_header_id|>ipython<|end_header_id|>\n\n"


def test_template_without_tools(tmp_path):
    tok = make_tokenizer(tmp_path, load_chat_template("llama3_json_tools"))
    text = tok.render_chat(
        [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "hi"}]
    )
    assert text == (
        f"<|begin_of_text|>{SYSTEM}{DATES}Be brief.<|eot_id|>{USER}hi<|eot_id|>{ASSISTANT}"
    )


def test_template_with_tools_and_tool_results(tmp_path):
    tok = make_tokenizer(tmp_path).with_chat_template(load_chat_template("llama3_json_tools"))
    assert tok.chat_template is not None
    tools = tools_for_template([make_tool("get_weather", {"type": "object"})])
    messages = [
        {"role": "user", "content": "Weather in Paris & Lyon?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "<22 C>"},
        {"role": "tool", "tool_call_id": "call_2", "content": "20 C"},
    ]
    text = tok.render_chat(messages, tools=tools)
    tool_json = json.dumps(tools[0], indent=4)
    assert text == (
        f"<|begin_of_text|>{SYSTEM}Environment: ipython\n{DATES}"
        "You are a helpful assistant with tool calling capabilities. Only reply with a tool call "
        "if the function exists in the library provided by the user. If it does not exist, just "
        "reply directly in natural language. When you receive a tool call response, use the "
        "output to format an answer to the original user question.<|eot_id|>"
        f"{USER}Given the following functions, please respond with a JSON for a function call "
        "with its proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument '
        "name and its value}. Do not use variables.\n\n"
        f"{tool_json}\n\nWeather in Paris & Lyon?<|eot_id|>"
        f'{ASSISTANT}{{"name": "get_weather", "parameters": {{"city": "Paris"}}}}; '
        '{"name": "get_weather", "parameters": {"city": "Lyon"}}<|eot_id|>'
        f'{IPYTHON}{{"output": "<22 C>"}}<|eot_id|>{IPYTHON}{{"output": "20 C"}}<|eot_id|>'
        f"{ASSISTANT}"
    )
    # what the template writes for a call is what the parser reads back
    written = text.split(ASSISTANT)[1].split("<|eot_id|>")[0]
    assert calls_of(written) == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Lyon"}),
    ]
    assert tok.apply_chat_template(messages, tools=tools) == tok.encode(text)


def test_tools_listed_in_system_prompt_when_no_user_message_comes_first(tmp_path):
    tok = make_tokenizer(tmp_path, load_chat_template("llama3_json_tools"))
    tools = tools_for_template([make_tool("f", None)])
    text = tok.render_chat([{"role": "assistant", "content": "Hello"}], False, tools)
    head, rest = text.split("<|eot_id|>", 1)
    assert '"name": "f"' in head and rest == f"{ASSISTANT}Hello<|eot_id|>"


def test_tools_reach_the_template_only_when_given(tmp_path):
    tok = make_tokenizer(tmp_path, "{{ 'tools' if tools is defined else 'none' }}")
    assert tok.render_chat([], tools=None) == "none"
    assert tok.render_chat([], tools=[]) == "tools"
    echo = make_tokenizer(tmp_path, "{{ messages | tojson }}")
    messages = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}],
        },
        {"role": "assistant", "content": "x", "tool_calls": None},
        {"role": "tool", "content": "<b>", "tool_call_id": "call_1"},
    ]
    assert json.loads(echo.render_chat(messages)) == [
        messages[0],  # arguments that are not JSON are shown as sent
        {"role": "assistant", "content": "x"},
        messages[2],
    ]
