"""Request bodies over the limit get 413 with an OpenAI-style error, and the limit must hold
before the body is read: a client that announces a huge body must not make the router buffer
(or wait for) it."""

from __future__ import annotations

import socket

import httpx
import pytest

from pdserve.router.openai_api.validation import MAX_BODY_BYTES

from .conftest import API_KEY

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def test_body_over_the_limit_is_413(secured):
    body = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    r = httpx.post(secured.url + "/v1/completions", content=body, headers=AUTH, timeout=60)
    assert r.status_code == 413
    assert str(MAX_BODY_BYTES) in r.json()["error"]["message"]


def test_body_at_the_limit_is_parsed(secured):
    """Just under the limit the body is read and validated (400 for the junk field), not 413."""
    filler = b"a" * (MAX_BODY_BYTES - 100)
    body = b'{"prompt": "x", "user": 1, "stop": "' + filler + b'"}'
    r = httpx.post(secured.url + "/v1/completions", content=body, headers=AUTH, timeout=60)
    assert r.status_code == 400


def raw_request(url: str, head: bytes, timeout_s: float) -> bytes:
    """Send only the request head (no body) and return what the server answers in time."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(head)
        try:
            return s.recv(4096)
        except TimeoutError:
            return b""


def test_announced_huge_body_is_refused_before_it_is_read(secured):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {API_KEY}\r\n".encode()
        + b"Content-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n{"
    )
    answer = raw_request(secured.url, head, timeout_s=3)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
