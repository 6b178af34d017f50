"""Send many generated inputs to a live router, concurrently, and judge every answer.

An answer is acceptable when it comes within TIMEOUT_S and is either a 2xx (a completion, or a
stream whose first event is read before the connection is dropped: that also exercises cancel)
or a 4xx carrying an OpenAI-style error object with a message. A 5xx, a 4xx without a message,
a dropped connection and a timeout are findings.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import httpx
from hypothesis import HealthCheck, Phase, given, settings

TIMEOUT_S = 30.0
TRIED: Counter = Counter()  # "suite status" -> inputs sent, for the terminal summary


class Input(NamedTuple):
    path: str
    body: bytes
    headers: dict[str, str] = {"Content-Type": "application/json"}
    method: str = "POST"


def draw(strategy, n: int) -> list:
    """n examples of a hypothesis strategy, the same on every run (derandomized)."""
    out: list = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(x):
        out.append(x)

    collect()
    return out


def judge(r: httpx.Response, content: bytes, valid: bool) -> str | None:
    """What is wrong with this answer, or None. `valid`: the input is valid by the documented
    schema, so only a prompt longer than the context window may be refused."""
    if r.status_code >= 500:
        return f"{r.status_code}: {content[:300]!r}"
    if r.status_code >= 400:
        try:
            error = json.loads(content)["error"]
            if error["message"] and (not valid or error["code"] == "context_length_exceeded"):
                return None
        except (ValueError, KeyError, TypeError):
            pass
        return f"{r.status_code} without an acceptable OpenAI error: {content[:300]!r}"
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        return None if content.startswith(b"data: ") else f"bad first event {content[:200]!r}"
    try:
        json.loads(content)["choices"]
    except (ValueError, KeyError, TypeError):
        return f"200 without choices: {content[:300]!r}"
    return None


def send(client: httpx.Client, url: str, item: Input, valid: bool) -> tuple[int, str | None]:
    """(status, finding or None). A stream is read up to its first event, then dropped."""
    t0 = time.monotonic()
    try:
        with client.stream(
            item.method, url + item.path, content=item.body, headers=item.headers
        ) as r:
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                content = next(r.iter_bytes(), b"")
            else:
                content = r.read()
            return r.status_code, judge(r, content, valid)
    except httpx.TimeoutException:
        return 0, f"no answer within {time.monotonic() - t0:.0f}s (hang)"
    except httpx.TransportError as exc:
        return 0, f"connection failed: {exc!r}"


def fuzz(
    url: str, suite: str, items: list[Input], valid: bool = False, concurrency: int = 8
) -> list[str]:
    """Send every item; returns the findings (input and what was wrong), counts statuses."""
    with httpx.Client(timeout=TIMEOUT_S) as client, ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda it: send(client, url, it, valid), items))
    findings = []
    for item, (status, problem) in zip(items, results, strict=True):
        TRIED[f"{suite} {status}"] += 1
        if problem is not None:
            findings.append(f"{item.method} {item.path} {item.body[:300]!r} -> {problem}")
    return findings
