"""The router's spans and the trace context it hands its workers (pdserve/tracing.py), with
the SDK's in-memory exporter in this process: placement under the request span, the same
context in the Admit, the Prefill and a migration's replayed Admit, and its events."""

from __future__ import annotations

import pytest

from pdserve import tracing
from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams

from .conftest import load, worker

memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")


@pytest.fixture
def spans():
    exporter = memory.InMemorySpanExporter()
    assert tracing.setup("pdserve-router", exporter=exporter)
    yield exporter
    tracing.disable()


def test_a_traced_request_hands_its_context_to_every_worker_and_migrates_with_it(core, spans):
    c = core(local_prefill_threshold=4)
    for wid, role in (("d0", "decode"), ("d1", "decode"), ("p0", "prefill")):
        c.workers[wid] = worker(wid, role, load())
    caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    span = tracing.start("request", {"traceparent": caller}, server=True)
    state = c.submit([1] * 40, SamplingParams(max_tokens=8), span=span)
    ((d, admit),) = c.channel.take()
    assert admit.trace == state.trace and state.trace.startswith("00-4bf92f3577b34da6")
    c.handle(d, m.Placement(state.request_id, [0] * 10, 0, ["tcp://127.0.0.1:9"]))
    ((_, prefill),) = c.channel.take()
    assert prefill.trace == state.trace
    c.handle("p0", m.PrefillDone(state.request_id, 70))
    c.channel.take()
    c.worker_lost(c.workers[d], "test")
    ((other, replay),) = c.channel.take()
    assert other != d and replay.skip_tokens == 1 and replay.trace == state.trace
    c.finish(state, abort=True)
    tracing.end(span)
    done = {s.name: s for s in spans.get_finished_spans()}
    assert done["request"].parent.span_id == int("00f067aa0ba902b7", 16)
    assert done["placement"].parent.span_id == done["request"].context.span_id
    assert done["placement"].attributes["pdserve.remote_prefill"] is True
    assert "threshold" in done["placement"].attributes["pdserve.why"]
    events = [(e.name, dict(e.attributes)) for e in done["request"].events]
    assert events[0] == ("migration", {"pdserve.from_worker": d, "pdserve.to_worker": other,
                                       "pdserve.tokens_streamed": 1})  # fmt: skip
    assert events[-1][0] == "abort"


def test_tracing_off_records_nothing_and_sends_no_context(core):
    assert not tracing.enabled() and tracing.start("request") is None
    c = core()
    c.workers["d0"] = worker("d0", "both", load())
    state = c.submit([1] * 8, SamplingParams(max_tokens=4))
    ((_, admit),) = c.channel.take()
    assert admit.trace == "" and state.span is None
