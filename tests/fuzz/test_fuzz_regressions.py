"""The fuzzers' findings, one minimal input each, against the live server: each is now
answered cleanly (served, or a 4xx with an OpenAI error object)."""

from __future__ import annotations

import httpx
import pytest

from . import inputs as i
from .driver import TIMEOUT_S, Input, fuzz, send

pytestmark = pytest.mark.slow
CASES = {
    "mixed-type token prompt": Input(i.COMPLETIONS, b'{"prompt": [5, "a"], "max_tokens": 1}'),
    "invalid UTF-8 in a string": Input(i.COMPLETIONS, b'{"prompt": "a\xff\xfe"}'),
    "deep nesting in an unknown field": Input(
        i.CHAT, b'{"messages": [], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    ),
    "top_k of 2**64": Input(
        i.COMPLETIONS, b'{"prompt": "a", "max_tokens": 1, "top_k": %d}' % 2**64
    ),
    "seed of 2**64": Input(i.COMPLETIONS, b'{"prompt": "a", "max_tokens": 1, "seed": %d}' % 2**64),
    "temperature 1e-40": Input(
        i.COMPLETIONS, b'{"prompt": "a", "max_tokens": 2, "temperature": 1e-40}'
    ),
    "top_p 1e-300": Input(i.COMPLETIONS, b'{"prompt": "a", "max_tokens": 2, "top_p": 1e-300}'),
}


@pytest.mark.parametrize("name", CASES)
def test_fuzz_finding_is_answered_cleanly(fuzz_server, name):
    """Served (the sampling edge cases) or a 4xx with a message: never 5xx or a false 429."""
    with httpx.Client(timeout=TIMEOUT_S) as client:
        status, problem = send(client, fuzz_server.url, CASES[name], valid=False)
    assert (problem, status == 429) == (None, False)


def test_wrong_routes_get_openai_errors(fuzz_server):
    assert fuzz(fuzz_server.url, "routes", i.other_routes()) == []
