"""A client that leaves before its first token frees the workers at once (Dynamo #13691): the
router notices the closed connection while it waits for the first token, not when it next
writes, and sends Abort to the decode and the prefill worker that hold the request."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from pdserve.protocol import messages as m

from .live_router import LiveRouter

LONG = "tell me a long story " * 200  # prefilled remotely, and slowly on a real worker


@pytest.fixture(scope="module", params=[None, "2.4"], ids=["uvicorn", "asgi-2.4"])
def router(request):
    """uvicorn's own server (ASGI 2.3 today), and one that claims ASGI 2.4, for which Starlette
    leaves noticing a disconnect to the app."""
    with LiveRouter(request.param) as live:
        yield live


def request_bytes(stream: bool) -> bytes:
    body = json.dumps({"prompt": LONG, "max_tokens": 8, "stream": stream}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def wait_for(what, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (found := what()):
        if time.monotonic() > deadline:
            return found
        time.sleep(0.01)
    return found


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_closing_before_its_first_token_aborts_the_prefill(router, stream):
    before = len(router.workers.of(m.Prefill, "p0"))
    with socket.create_connection(("127.0.0.1", router.port), timeout=5) as s:
        s.sendall(request_bytes(stream))
        prefills = wait_for(lambda: router.workers.of(m.Prefill, "p0")[before:], 10)
        assert prefills, "the router never sent the prompt to the prefill worker"
        if not stream:  # nothing has come back: the answer waits for the first token
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    closed = time.monotonic()
    rid = prefills[0][0].request_id
    aborts = wait_for(lambda: [t for msg, t in router.workers.of(m.Abort, "p0")
                               if msg.request_id == rid], 5)  # fmt: skip
    assert aborts, "the router never told the prefill worker to stop"
    assert aborts[0] - closed < 2.0, f"Abort came {aborts[0] - closed:.1f} s after the close"
    assert [msg for msg, _ in router.workers.of(m.Abort, "d0") if msg.request_id == rid]
    assert wait_for(lambda: not router.frontend.core.requests, 2)


def test_a_client_that_leaves_while_queued_for_capacity_is_never_submitted(router):
    gate, loop = router.frontend.gate, router.workers.loop
    hog = asyncio.run_coroutine_threadsafe(gate.enter("hog", 0, gate.capacity), loop).result(5)
    admits = len(router.workers.of(m.Admit, "d0"))
    try:
        with socket.create_connection(("127.0.0.1", router.port), timeout=5) as s:
            s.sendall(request_bytes(stream=False))
            assert wait_for(lambda: gate.waiting, 5), "the request did not queue for capacity"
        assert wait_for(lambda: not gate.waiting, 2), "it kept its place in the queue"
    finally:
        loop.call_soon_threadsafe(gate.leave, hog)
    time.sleep(0.2)
    assert len(router.workers.of(m.Admit, "d0")) == admits  # no worker ever saw it
    assert gate.used == 0


def test_a_client_that_leaves_while_sending_its_body_is_no_error(router, caplog):
    head = b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"pro'
    admits = len(router.workers.of(m.Admit, "d0"))
    with socket.create_connection(("127.0.0.1", router.port), timeout=5) as s:
        s.sendall(head)
        time.sleep(0.3)
    time.sleep(0.5)
    assert "unhandled error" not in caplog.text
    assert len(router.workers.of(m.Admit, "d0")) == admits
