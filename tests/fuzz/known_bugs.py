"""Inputs that hit a reported but not yet fixed bug, held back from the general fuzzers so that
one known failure does not hide new findings (counted as "held-back(known bug)"). Add a
predicate here together with a strict-xfail test in test_fuzz_regressions.py that sends a
minimal such input; remove both once the fix lands. Empty: every finding so far is fixed
(docs/reliability.md lists them)."""

from __future__ import annotations

import json

KNOWN: dict = {}  # name -> predicate(body dict); empty: every finding so far is fixed


def known_bug(raw: bytes) -> str | None:
    """The known bug this request body would hit, or None."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    return next((name for name, hits in KNOWN.items() if hits(body)), None)
