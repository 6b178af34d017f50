"""The output constraint a request asks for (response_format, structured_outputs, or the
guided_* extensions), as the GuideSpec that travels in its SamplingParams."""

from __future__ import annotations

import json

from pdserve.engine.guided import GuideSpec, check_spec
from pdserve.router.openai_api.errors import APIError
from pdserve.router.openai_api.schemas import SamplingFields


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
