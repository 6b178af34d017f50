"""An OpenAPI 3.1 document for the two generation endpoints, built from the router's own msgspec
request schemas (FastAPI's generated one is empty: the endpoints take a raw Request) and
tightened with the semantic rules the router enforces (temperature in [0, 2], ...), so
that a schema-valid request must be served and each violation must be a 4xx."""

from __future__ import annotations

import msgspec

from pdserve.router.openai_api import schemas as p

ENDPOINTS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatRequest"}
MODEL = "SmolLM2-135M-Instruct.Q4_1"
VOCAB = 49152
NULL = {"type": "null"}
U64 = 2**64 - 1  # msgspec decodes integers in [-2**63, 2**64 - 1]


def positive_int(maximum: int) -> dict:
    return {"anyOf": [{"type": "integer", "minimum": 1, "maximum": maximum}, NULL]}


RULES = {  # what openai_api.validation, SamplingParams and Frontend.prepare accept
    "model": {"anyOf": [{"const": MODEL}, NULL]},
    "max_tokens": positive_int(2**31 - 1),
    "max_completion_tokens": positive_int(U64),
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 2},  # up to 16 served; kept short here
    "echo": {"type": "boolean"},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "stop_token_ids": {
        "anyOf": [
            {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": VOCAB - 1}},
            NULL,
        ]
    },
    "top_logprobs": NULL,  # needs logprobs=true (a dependency the schema does not express)
    # output constraints and tools need a valid schema / a tool template: covered by their tests
    "response_format": NULL,
    "structured_outputs": NULL,
    "guided_json": NULL,
    "guided_regex": NULL,
    "guided_grammar": NULL,
    "tools": NULL,
    "tool_choice": {"anyOf": [{"const": "none"}, NULL]},
    "logit_bias": NULL,
    # OpenAI fields pdserve cannot honour: served only at the values it has anyway
    **{
        k: NULL
        for k in (
            "suffix",
            "metadata",
            "prediction",
            "audio",
            "reasoning_effort",
            "verbosity",
            "web_search_options",
            "functions",
            "function_call",
        )
    },  # fmt: skip
    "priority": {"type": "integer", "minimum": -(2**31) + 1, "maximum": 2**31 - 1},
    "best_of": {"anyOf": [{"const": 1}, NULL]},
    "service_tier": {"anyOf": [{"enum": ["auto", "default"]}, NULL]},
    "store": {"anyOf": [{"const": False}, NULL]},
    "modalities": {"anyOf": [{"const": ["text"]}, NULL]},
    "parallel_tool_calls": {"anyOf": [{"const": True}, NULL]},
    "seed": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 2**63 - 1}, NULL]},
    "stop": {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4},
            NULL,
        ]
    },
    "prompt": {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": VOCAB - 1},
                "minItems": 1,
            },
        ]
    },
    "messages": {
        "type": "array",
        "items": {"$ref": "#/components/schemas/ChatMessage"},
        "minItems": 1,
    },
}
ROLES = ["system", "user", "assistant", "tool", "developer"]


def _operation(schema_name: str) -> dict:
    ref = {"$ref": f"#/components/schemas/{schema_name}"}
    error = {"description": "OpenAI-style error object"}
    return {
        "post": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
            "responses": {"200": {"description": "completion"}, "400": error, "404": error},
        }
    }


def openapi() -> dict:
    _, components = msgspec.json.schema_components(
        [p.CompletionRequest, p.ChatRequest], ref_template="#/components/schemas/{name}"
    )
    for name in ENDPOINTS.values():
        props = components[name]["properties"]
        props.update({k: v for k, v in RULES.items() if k in props})
    logprobs = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 20}, NULL]}
    components["CompletionRequest"]["properties"]["logprobs"] = logprobs
    components["ChatMessage"]["properties"]["role"] = {"enum": ROLES}
    components["ContentPart"]["properties"]["type"] = {"const": "text"}  # the model reads text
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve router", "version": "1"},
        "paths": {path: _operation(name) for path, name in ENDPOINTS.items()},
        "components": {"schemas": components},
    }
