"""RouterCore's message handlers, failure detection and migration, with exact messages sent
(no sockets: the core sends into a Recorder)."""

from __future__ import annotations

import asyncio

from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams
from pdserve.router.state import ErrorEvent, RequestEvent, RequestState, TokenEvent

from .conftest import load, pending, worker

PARAMS = SamplingParams(max_tokens=8)


def _disagg(core, decoders=("d0", "d1")):
    c = core(local_prefill_threshold=4)
    for wid in decoders:
        c.workers[wid] = worker(wid, "decode", load())
    c.workers["p0"] = worker("p0", "prefill", load())
    return c


def _events(state: RequestState) -> list[RequestEvent]:
    out = []
    while not state.events.empty():
        out.append(state.events.get_nowait())
    return out


def test_deliver_drops_duplicates_and_gaps_and_ends_on_a_repeated_last_token():
    s = RequestState("r", [1, 2], PARAMS, remote=True)
    assert s.deliver(0, 10, None)
    assert not s.deliver(0, 10, None)  # a replay of what the client has
    assert not s.deliver(2, 12, None)  # a gap: index 1 is missing
    assert s.deliver(1, 11, None)
    assert s.tokens == [10, 11]
    assert s.deliver(1, 11, "length")  # the last token again, now with the finish reason
    assert s.finished and not s.deliver(2, 12, None)
    assert _events(s) == [
        TokenEvent(10, None, None),
        TokenEvent(11, None, None),
        TokenEvent(None, "length", None),
    ]
    s.fail(500, "late")  # nothing after the end
    assert _events(s) == []


def test_a_remote_request_goes_admit_placement_prefill_prefilldone_kvready(core):
    c = _disagg(core, decoders=("d0",))
    state = c.submit([5] * 40, PARAMS)
    assert state.remote and state.decode_id == "d0"
    [(wid, admit)] = c.channel.take()
    assert wid == "d0" and admit == m.Admit(state.request_id, [5] * 40, PARAMS, True, 120.0)
    c.handle("d0", m.Placement(state.request_id, [7, 8, 9], 16, ["tcp://d0:1"]))
    prefill = m.Prefill(state.request_id, [5] * 40, PARAMS, ["tcp://d0:1"], [7, 8, 9], 16)
    assert c.channel.take() == [("p0", prefill)]
    assert state.prefill_id == "p0" and state.request_id in c.workers["p0"].inflight
    c.handle("p0", m.PrefillDone(state.request_id, 42, transfer_bytes=100))
    assert c.channel.take() == [("d0", m.KVReady(state.request_id, 42))]
    assert state.tokens == [42] and state.request_id not in c.workers["p0"].inflight
    c.handle("d1", m.Tokens("d1", [m.TokenOut(state.request_id, 1, 43, None)]))  # not its D
    c.handle("d0", m.Tokens("d0", [m.TokenOut(state.request_id, 1, 44, "length")]))
    assert state.tokens == [42, 44] and state.finished


def test_a_failed_prefill_makes_the_decode_worker_prefill_locally(core):
    c = _disagg(core)
    state = pending(c, "r0", 40, remote=True, decode_id="d0")
    c.handle("p0", m.PrefillDone("r0", None, error="push timed out"))
    assert c.channel.take() == [("d0", m.KVReady("r0", None))]
    assert state.tokens == [] and not state.finished


def test_a_placement_for_a_forgotten_request_is_aborted_and_no_pool_means_local(core):
    c = _disagg(core)
    c.handle("d0", m.Placement("gone", [1], 0, ["tcp://d0:1"]))
    assert c.channel.take() == [("d0", m.Abort("gone"))]
    pending(c, "r0", 40, remote=True, decode_id="d0")
    c.workers["p0"].alive = False
    c.handle("d0", m.Placement("r0", [1, 2, 3], 0, ["tcp://d0:1"]))
    assert c.channel.take() == [("d0", m.KVReady("r0", None))]


def test_a_lost_decode_worker_migrates_with_the_streamed_tokens_skipped(core):
    c = _disagg(core)
    state = pending(c, "r0", 10, remote=False, decode_id="d0")
    state.deliver(0, 70, None)
    state.deliver(1, 71, None)
    c.worker_lost(c.workers["d0"], "test")
    params = SamplingParams(max_tokens=6)  # 8 - the 2 tokens already streamed
    admit = m.Admit("r0", [1] * 10 + [70, 71], params, False, 120.0, skip_tokens=2)
    assert c.channel.take() == [("d1", admit)]
    assert state.decode_id == "d1" and state.migrations == 1 and not c.workers["d0"].inflight
    # the new worker's replay starts at index 2: nothing is delivered twice
    c.handle("d1", m.Tokens("d1", [m.TokenOut("r0", 2, 72, None)]))
    assert state.tokens == [70, 71, 72]


def test_a_lost_prefill_worker_hands_its_prompt_to_the_decode_worker(core):
    c = _disagg(core)
    state = pending(c, "r0", 40, remote=True, decode_id="d0")
    state.prefill_id = "p0"
    c.workers["p0"].inflight.add("r0")
    c.worker_lost(c.workers["p0"], "test")
    assert c.channel.take() == [("d0", m.KVReady("r0", None))]
    assert not c.workers["p0"].alive and not state.finished


def test_migration_fails_the_request_with_503_when_no_worker_can_take_it(core):
    c = _disagg(core, decoders=("d0",))
    state = pending(c, "r0", 10, remote=False, decode_id="d0")
    c.worker_lost(c.workers["d0"], "test")
    assert state.finished and _events(state) == [
        ErrorEvent(503, "the worker serving this request failed and no other can take it")
    ]
    assert c.channel.take() == []


def test_silent_workers_are_declared_lost_and_a_stalled_one_is_reset_when_it_speaks(core):
    c = _disagg(core)
    now = c.workers["d0"].last_seen
    c.workers["d1"].last_seen = now + 10
    c.workers["p0"].last_seen = now + 10
    c.check_liveness(now + c.config.heartbeat_timeout_s + 1)
    assert [w.worker_id for w in c.alive()] == ["d1", "p0"]
    c.handle("d0#hb", m.Heartbeat("d0", load()))  # it was only stalled
    assert c.channel.take() == [("d0", m.Reset())]
    c.handle("d0#hb", m.Heartbeat("d0", load()))  # at most one Reset a second
    assert c.channel.take() == [] and not c.workers["d0"].alive  # alive again once registered
    c.handle("d1#hb", m.Heartbeat("d0", load()))  # another worker's socket: ignored
    assert c.channel.take() == []


def test_registration_refuses_a_worker_with_another_kv_layout(core):
    from pdserve.kv_transfer import KVLayout

    c = core()
    layout = KVLayout("model-a", "bfloat16", 30, 16, 3, 64)
    reg = m.Register("d0", "decode", layout, "tcp://d0:1", 100, 2048)
    c.handle("d0", reg)
    assert c.channel.take() == [("d0", m.RegisterAck(True))]
    other_layout = KVLayout("model-b", "bfloat16", 30, 16, 3, 64)
    other = m.Register("d1", "decode", other_layout, None, 100, 2048)
    c.handle("d1", other)
    [(wid, ack)] = c.channel.take()
    assert wid == "d1" and not ack.ok and "model" in ack.error
    assert list(c.workers) == ["d0"]
    assert c.refused == {"d1": ack.error}  # GET /health reports it
    c.handle("d1", m.Register("d1", "decode", layout, None, 100, 2048))  # fixed and back
    assert c.channel.take() == [("d1", m.RegisterAck(True))] and c.refused == {}


def test_registration_refuses_a_prefill_worker_whose_kv_transport_its_decoders_lack(core):
    from pdserve.kv_transfer import KVLayout

    c = core()
    layout = KVLayout("model-a", "bfloat16", 30, 16, 3, 64)
    c.handle("d0", m.Register("d0", "decode", layout, "nixl://d0", 100, 2048, kv_transport="nixl"))
    c.handle("b0", m.Register("b0", "both", layout, None, 100, 2048))  # never exchanges KV
    assert c.channel.take() == [("d0", m.RegisterAck(True)), ("b0", m.RegisterAck(True))]
    c.handle("p0", m.Register("p0", "prefill", layout, None, 100, 2048, kv_transport="tcp"))
    [(wid, ack)] = c.channel.take()
    assert wid == "p0" and not ack.ok
    assert "over tcp" in ack.error and "--kv-transport nixl" in ack.error
    assert sorted(c.workers) == ["b0", "d0"] and c.refused == {"p0": ack.error}
    c.handle("p0", m.Register("p0", "prefill", layout, None, 100, 2048, kv_transport="nixl"))
    assert c.channel.take() == [("p0", m.RegisterAck(True))] and c.refused == {}


def test_finish_with_abort_frees_the_request_on_every_worker_holding_it(core):
    c = _disagg(core)
    state = pending(c, "r0", 40, remote=True, decode_id="d0")
    state.prefill_id = "p0"
    c.workers["p0"].inflight.add("r0")
    c.finish(state, abort=True)
    assert c.channel.take() == [("d0", m.Abort("r0")), ("p0", m.Abort("r0"))]
    assert "r0" not in c.requests and not c.workers["d0"].inflight


def test_wait_for_workers_counts_decoders_and_the_prefill_pool(core):
    c = _disagg(core)
    assert asyncio.run(c.wait_for_workers(prefill=1, decode=2, timeout_s=0.1))
    assert not asyncio.run(c.wait_for_workers(prefill=2, decode=2, timeout_s=0.1))


def test_ready_once_every_expected_worker_registered_then_while_a_decoder_is_up(core):
    from pdserve.kv_transfer import KVLayout

    c = core()
    c.expected = (1, 2)
    layout = KVLayout("model-a", "bfloat16", 30, 16, 3, 64)
    for wid, role in (("d0", "decode"), ("p0", "prefill")):
        c.handle(wid, m.Register(wid, role, layout, None, 100, 2048))
        assert not c.ready  # start-up is not over
    c.handle("d1", m.Register("d1", "decode", layout, None, 100, 2048))
    assert c.ready
    c.worker_lost(c.workers["p0"], "test")
    c.worker_lost(c.workers["d0"], "test")
    assert c.ready  # d1 still decodes: start-up is over, the server serves
    c.worker_lost(c.workers["d1"], "test")
    assert not c.ready


def test_a_worker_this_router_does_not_know_is_reset_and_its_cache_index_comes_back(core):
    """After a router restart: the worker's heartbeats reach a router that never saw it."""
    from pdserve.kv_transfer import KVLayout

    c = core()
    c.handle("d0#hb", m.Heartbeat("d0", load()))
    assert c.channel.take() == [("d0", m.Reset())]
    layout = KVLayout("model-a", "bfloat16", 30, 16, 3, 64)
    c.handle("d0", m.Register("d0", "decode", layout, None, 100, 2048, cached=[11, 12]))
    assert c.workers["d0"].cached == {11, 12} and c.workers["d0"].overlap([11, 12, 13]) == 2
    c.handle("d0#hb", m.Heartbeat("d0", load()))  # known now: no Reset, the router answers
    assert c.channel.take() == [("d0", m.RegisterAck(True)), ("d0", m.RouterBeat())]
