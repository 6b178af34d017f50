"""Hostile inputs to the OpenAI endpoints of a live disaggregated server: no 5xx, every 4xx an
OpenAI error object with a message, every request answered in time, and afterwards the server
is healthy with every KV block free (checked when the session's fuzz server stops)."""

from __future__ import annotations

import pytest

from . import inputs as i
from .driver import TRIED, Input, draw, fuzz
from .known_bugs import known_bug

pytestmark = pytest.mark.slow


def send_all(server, suite: str, items: list[Input]) -> None:
    held = [it for it in items if known_bug(it.body)]
    TRIED[f"{suite} held-back(known bug)"] += len(held)
    findings = fuzz(server.url, suite, [it for it in items if not known_bug(it.body)])
    assert findings == [], "\n".join(findings[:20])
    assert server.health()  # still answering


def test_random_bytes(fuzz_server):
    send_all(fuzz_server, "bytes", draw(i.random_bytes, 150))


def test_random_json_values(fuzz_server):
    send_all(fuzz_server, "json", draw(i.whole_value_junk, 150))


@pytest.mark.parametrize("path", [i.COMPLETIONS, i.CHAT])
def test_every_field_with_junk(fuzz_server, path):
    send_all(fuzz_server, f"fields{path}", draw(i.field_junk(path), 250))


def test_chat_messages_with_junk(fuzz_server):
    send_all(fuzz_server, "messages", draw(i.chat_message_junk, 150))


def test_raw_texts_and_headers(fuzz_server):
    send_all(fuzz_server, "raw", i.raw_inputs())
