"""Wait for a condition instead of sleeping a fixed time and hoping it holds by then.

A fixed sleep is too short on a busy machine (the test flakes) and too long on an idle one (the
suite crawls); `wait_until` returns as soon as the condition holds and, when it never does,
fails saying what was awaited and what was last seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.05,
    state: Callable[[], object] | None = None,
) -> T:
    """Poll `predicate` until it returns something truthy and return that. After `timeout_s`
    raise AssertionError naming `what` (and `state()`, what was last seen, when given)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            seen = f"; last seen: {state()}" if state is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{seen}")
        time.sleep(interval_s)
