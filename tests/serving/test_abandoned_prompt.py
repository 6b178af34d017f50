"""A client that leaves before its first token does not keep the prefill pool busy (Dynamo
#13691): the real `pdserve serve --mode disagg` with step logs, and a raw socket that sends a
long streamed prompt and closes, as a browser tab closing does. The router notices the
disconnect while it waits for the first token and aborts the request on every worker; the
prefill worker stops between two chunks of the prompt, pushes nothing, and frees its blocks."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from servers import Server
from waiting import wait_until

PROMPT_TOKENS = 6000  # ~6 chunks of 1,024 on the prefill worker: seconds of work on one core


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    steps = tmp_path_factory.mktemp("steps")
    with Server("--mode", "disagg", "--local-prefill-threshold", "0",
                "--step-log", str(steps)) as srv:  # fmt: skip
        srv.steps = steps
        yield srv


def _prefill_steps(directory: Path) -> list[dict]:
    """The prefill worker's steps after its warm-up (whose prompt is 128 tokens)."""
    records = []
    for path in directory.glob("steps-prefill-*.jsonl"):
        records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return [r for r in records if r["prefill_tokens"] > 128]


def _send_and_leave(port: int, body: dict, leave_when) -> None:
    """POST `body` as a streaming completion on a raw socket; close it once `leave_when()`,
    before a byte of the answer has been read."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        sock.sendall(head + payload)
        wait_until(leave_when, 120, "the prefill worker to start on the prompt")
    finally:
        sock.close()


def test_a_prompt_whose_client_left_is_not_prefilled_to_its_end(server):
    prompt = [100 + (i * 7919) % 40000 for i in range(PROMPT_TOKENS)]
    body = {"prompt": prompt, "max_tokens": 16, "stream": True, "ignore_eos": True}
    _send_and_leave(server.port, body, lambda: _prefill_steps(server.steps))
    workers = server.wait_idle_and_clean(timeout_s=120)  # every block free, nothing running
    computed = sum(r["prefill_tokens"] for r in _prefill_steps(server.steps))
    assert 0 < computed < PROMPT_TOKENS, computed  # stopped between chunks, before the end
    assert all(w["free_blocks"] == w["total_blocks"] for w in workers.values())
