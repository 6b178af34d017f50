"""Inputs that hit bugs already reported (docs/reliability.md lists them with their patches),
held back from the general fuzzers so that a known failure does not hide new findings. Each has
a strict-xfail regression test (test_fuzz_regressions.py or the chaos suite) that sends it:
delete its entry here once that test passes."""

from __future__ import annotations

import json


def _mixed_token_prompt(body) -> bool:
    """prompt [5, "a"] or [5, [1]]: the router compares str/list to int (TypeError -> 500)."""
    prompt = body.get("prompt")
    return (
        isinstance(prompt, list)
        and len(prompt) > 1
        and type(prompt[0]) is int
        and any(type(t) is not int for t in prompt)
    )


def _negative_max_completion_tokens(body) -> bool:
    """Not validated by the router; the decode worker that gets it exits (chaos suite)."""
    value = body.get("max_completion_tokens")
    return type(value) is int and value < 0


def _beyond_64_bits(body) -> bool:
    """top_k or seed >= 2**64 decodes, then fails to encode for the worker: OverflowError,
    reported as 429, and the request's state is never freed (256 of them brick the router)."""
    return any(type(body.get(k)) is int and body[k] >= 2**64 for k in ("top_k", "seed"))


def _underflowing_sampling(body) -> bool:
    """0 < temperature < ~1e-38 or 0 < top_p < ~1e-38: NaN probabilities, the engine step
    raises and every request in that batch fails with 500."""
    vals = [body.get("temperature", 1.0), body.get("top_p", 1.0)]
    return any(type(v) in (int, float) and 0 < v < 1e-30 for v in vals)


KNOWN = {
    "top_k/seed >= 2**64 -> 429 and a leaked request slot": _beyond_64_bits,
    "tiny temperature/top_p -> NaN, the whole batch fails": _underflowing_sampling,
    "mixed-type token prompt -> 500": _mixed_token_prompt,
    "max_completion_tokens < 0 kills a decode worker": _negative_max_completion_tokens,
}


def known_bug(raw: bytes) -> str | None:
    """The known bug this request body would hit, or None."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    try:
        body = json.loads(raw.decode("utf-8", "replace"))
    except RecursionError:  # inside an object: msgspec skips unknown fields recursively
        if not raw.lstrip().startswith(b"{"):
            return None
        return "nesting beyond msgspec's depth limit -> RecursionError, connection reset"
    except ValueError:
        return None
    if text is None:
        return "JSON with invalid UTF-8 inside a string -> UnicodeDecodeError, 500"
    if not isinstance(body, dict):
        return None
    return next((name for name, hits in KNOWN.items() if hits(body)), None)
