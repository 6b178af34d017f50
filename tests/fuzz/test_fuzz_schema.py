"""Schemathesis drives both endpoints from an OpenAPI document built from the router's own
request schemas (schema.py): positive cases and negative cases (every way the schema can be
violated). The document carries the router's semantic rules, so a positive case must be served
(200, or 400 only for a prompt longer than the context window) and a negative one must get a
clean 4xx."""

from __future__ import annotations

import json
import warnings

import pytest

from .driver import TRIED, Input, draw, fuzz
from .known_bugs import known_bug
from .schema import ENDPOINTS, openapi

pytestmark = pytest.mark.slow
COUNTS = {"positive": 15, "negative": 150}


def integral_floats_as_ints(value):
    """JSON Schema counts 2.0 as an integer; msgspec (strict) refuses it for an int field with
    a clear 400. Positive cases send 2 instead, so that they test what they mean to."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: integral_floats_as_ints(v) for k, v in value.items()}
    return value


def to_input(case, positive: bool) -> Input:
    kw = case.as_transport_kwargs(base_url="http://router")
    if "json" in kw:
        value = integral_floats_as_ints(kw["json"]) if positive else kw["json"]
        body = json.dumps(value).encode()
    else:
        data = kw.get("data") or b""
        body = data.encode() if isinstance(data, str) else bytes(data)
    path = kw["url"].removeprefix("http://router")
    return Input(path, body, {k: str(v) for k, v in kw["headers"].items()}, kw["method"])


def cases(path: str, mode: str) -> list[Input]:
    import schemathesis
    from schemathesis.generation.modes import GenerationMode

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        operation = schemathesis.openapi.from_dict(openapi())[path]["POST"]
        strategy = operation.as_strategy(generation_mode=GenerationMode(mode))
        return [to_input(c, mode == "positive") for c in draw(strategy, COUNTS[mode])]


@pytest.mark.parametrize("mode", list(COUNTS))
@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_schemathesis_cases(fuzz_server, path, mode):
    items = cases(path, mode)
    assert len(items) >= COUNTS[mode] // 2  # hypothesis may stop early on duplicates only
    suite = f"schemathesis-{mode}{path}"
    held = [it for it in items if known_bug(it.body)]
    TRIED[f"{suite} held-back(known bug)"] += len(held)
    sent = [it for it in items if not known_bug(it.body)]
    findings = fuzz(fuzz_server.url, suite, sent, valid=mode == "positive")
    assert findings == [], "\n".join(findings[:20])
