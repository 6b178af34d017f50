import asyncio
import statistics
import time

import pytest

from pdserve.bench.client import Endpoint, make_client, send_request
from pdserve.bench.workload import RequestSpec

from .stub_server import StubConfig, StubServer

TOLERANCE_S = 0.005


def send_all(url: str, n: int, output_tokens: int = 6, sequential=False, **endpoint) -> list:
    """Send `n` requests at once (or one after another) and return their records."""

    async def go():
        ep = Endpoint(url, **endpoint)
        async with make_client() as client:
            await client.get(url + "/models")  # connection path warmed, as the runner does
            t0 = 0.0  # start_s is then time.perf_counter(), comparable with the stub's clock
            specs = [RequestSpec(i, 0.0, "chat", 3, output_tokens) for i in range(n)]
            if sequential:
                return [await send_request(client, ep, s, "a b c", t0) for s in specs]
            return await asyncio.gather(*(send_request(client, ep, s, "a b c", t0) for s in specs))

    return asyncio.run(go())


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_measured_latencies_match_the_stub_delays(api):
    # One after another, and medians: a scheduling hiccup on a busy machine moves one sample.
    stub = StubServer(StubConfig(ttft_s=0.04, itl_s=0.02))
    with stub as url:
        records = send_all(url, 7, output_tokens=5, sequential=True, api=api)
    assert [r.status for r in records] == ["ok"] * 7
    assert [r.output_tokens for r in records] == [5] * 7
    assert [len(r.itl_s) for r in records] == [4] * 7
    # TTFT also holds the request's way to the server, which the stub's clock starts after:
    # on a busy machine that alone can take several ms, so it is measured and taken out.
    transit = [seen - r.start_s for seen, r in zip(stub.handler.received, records, strict=True)]
    ttft = statistics.median(r.ttft_s - t for r, t in zip(records, transit, strict=True))
    assert abs(ttft - 0.04) < TOLERANCE_S
    assert abs(statistics.median(x for r in records for x in r.itl_s) - 0.02) < TOLERANCE_S
    assert abs(statistics.median(r.tpot_s for r in records) - 0.02) < TOLERANCE_S
    tail = [r.e2e_s - r.ttft_s - sum(r.itl_s) for r in records]  # last token -> [DONE]
    assert min(tail) >= 0
    assert statistics.median(tail) < TOLERANCE_S


def test_tokens_are_counted_when_the_server_sends_no_usage():
    with StubServer(StubConfig(ttft_s=0.0, itl_s=0.0, send_usage=False)) as url:
        (record,) = send_all(url, 1, output_tokens=9)
    assert (record.status, record.output_tokens, record.prompt_tokens) == ("ok", 9, 3)


@pytest.mark.parametrize(
    "fault, status, error",
    [
        ("http500", "error", 'HTTP 500: {"error": "stub failure"}'),
        ("close_early", "error", "stream closed before [DONE] after 3 tokens"),
        (
            "disconnect",
            "error",
            "ClientPayloadError: Response payload is not completed: <TransferEncodingError: 400, "
            "message='Not enough data to satisfy transfer length header.'>",
        ),
        ("malformed", "error", "malformed SSE data after 3 tokens: '{oops'"),
        ("error_event", "error", "error in stream after 3 tokens: {'message': 'kv lost'}"),
        ("hang", "timeout", "no complete answer within 0.3 s"),
    ],
)
def test_a_bad_server_gives_records_with_reasons(fault, status, error):
    # Every other request fails; the rest must be unaffected.
    with StubServer(StubConfig(ttft_s=0.0, itl_s=0.001, fault=fault, fault_every=2)) as url:
        records = send_all(url, 4, output_tokens=6, timeout_s=0.3)
    assert sorted(r.index for r in records) == [0, 1, 2, 3]
    assert sorted((r.status, r.error) for r in records) == sorted(
        [(status, error)] * 2 + [("ok", None)] * 2
    )
    failed = [r for r in records if not r.ok]
    assert all(r.tpot_s is None for r in failed)


def test_connection_refused_is_an_error_record():
    with StubServer(StubConfig()) as url:
        pass  # closed: nothing listens on that port any more
    (record,) = _refused(url)
    assert record.status == "error"
    assert record.error.startswith("ClientConnectorError")


def _refused(url: str) -> list:
    async def go():
        async with make_client() as client:
            spec = RequestSpec(0, 0.0, "chat", 3, 2)
            return [await send_request(client, Endpoint(url), spec, "a b c", time.perf_counter())]

    return asyncio.run(go())


def test_payload_uses_only_the_public_api_fields():
    ep = Endpoint("http://h:1/v1/", model="m", ignore_eos=False)
    assert ep.target == "http://h:1/v1/completions"
    assert ep.payload("hi", 5) == {
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "model": "m",
        "prompt": "hi",
    }
    chat = Endpoint("http://h:1/v1", api="chat", api_key="k")
    assert chat.target == "http://h:1/v1/chat/completions"
    assert chat.payload("hi", 5)["messages"] == [{"role": "user", "content": "hi"}]
    assert chat.payload("hi", 5)["ignore_eos"] is True
    assert chat.headers == {"Authorization": "Bearer k"}
    sampled = Endpoint("http://h:1/v1", temperature=1.0, top_p=0.95).payload("hi", 5)
    assert sampled["temperature"] == 1.0 and sampled["top_p"] == 0.95


def test_endpoint_validation():
    with pytest.raises(ValueError, match="--url must start with http:// or https://"):
        Endpoint("127.0.0.1:8000/v1")
    with pytest.raises(ValueError, match="unknown API 'grpc'"):
        Endpoint("http://h/v1", api="grpc")
    with pytest.raises(ValueError, match="--temperature must be >= 0"):
        Endpoint("http://h/v1", temperature=-1)
    with pytest.raises(ValueError, match=r"--top-p must be in \(0, 1\]"):
        Endpoint("http://h/v1", top_p=0)
