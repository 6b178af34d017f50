"""KV pushes that break on the wire between real processes (`PDSERVE_KV_FAULT`, the tcp and
nixl connectors' test-only switch): a connection reset mid-layer, a frame cut short, a corrupted
frame, a receiver that stops reading.
Every request still completes with the tokens the offline engine gives (the decode worker
prefills it itself), and no block is left held on either side."""

from __future__ import annotations

import httpx
import pytest
from servers import Server, metric

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, " * 12]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected():
    llm = LLM(dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return {p: llm.generate(p, params)[0].text for p in PROMPTS}


def assert_expected_answers(server: Server, prompts: list[str], expected: dict) -> None:
    for prompt in prompts:
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                  "temperature": 0},
            timeout=30,  # a fault costs a local prefill or the 2 s transfer timeout, never more
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected[prompt], prompt


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_pushes_broken_on_the_wire_cost_time_not_tokens(transport, expected):
    """Every 4th layer the prefill worker sends breaks, as a reset, a truncated frame and a
    corrupted one in turn: each request's push fails at its 4th layer (the connection is then
    gone), so the six requests meet each kind twice, one server taking them one after another."""
    env = {"PDSERVE_KV_FAULT": "reset+truncate+corrupt:4"}
    with Server(
        "--mode", "disagg", "--dtype", "float32", "--local-prefill-threshold", "0",
        "--kv-transport", transport, env=env,
    ) as server:  # fmt: skip
        assert_expected_answers(server, PROMPTS * 2, expected)
        assert metric(server.url, "pdserve_kv_transfer_failures_total") >= 3
        for kind in ("reset", "truncate", "corrupt"):
            assert any(f"injected KV fault: {kind}" in x for x in server.lines), kind
        server.wait_idle_and_clean()  # every block free on both workers, integrity intact


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_a_receiver_that_stops_reading_costs_the_transfer_timeout_not_tokens(transport, expected):
    """The decode worker's receiver stops reading at its 40th layer header (the second
    request's 10th layer): the prefill worker gives the push up after --transfer-timeout-s
    and drops that connection, the decode worker prefills the prompt itself, nothing lands
    afterwards, and the next pushes go through a new connection."""
    env = {"PDSERVE_KV_FAULT": "stall:40"}
    with Server(
        "--mode", "disagg", "--dtype", "float32", "--local-prefill-threshold", "0",
        "--kv-transport", transport, "--transfer-timeout-s", "2", env=env,
    ) as server:  # fmt: skip
        assert_expected_answers(server, PROMPTS, expected)
        assert metric(server.url, "pdserve_kv_transfer_failures_total") == 1
        remote = 'pdserve_prefill_decisions_total{where="remote"}'
        assert metric(server.url, remote) == len(PROMPTS)
        server.wait_idle_and_clean()
