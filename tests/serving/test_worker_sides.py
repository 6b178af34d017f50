"""A worker's decode and prefill sides without processes or a router: a tiny model, the
in-process KV connector, and the test relaying the messages the router would."""

from __future__ import annotations

import time
import types

import pytest
from factories import make_engine, make_model_files, run_to_completion

from pdserve import tracing
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import make_receiver, make_sender
from pdserve.kv_transfer.inproc import FaultPlan
from pdserve.kv_transfer.memory import layout_of
from pdserve.protocol import messages as m
from pdserve.serving.decode_side import DecodeSide
from pdserve.serving.prefill_side import PrefillSide

PROMPT = list(range(3, 21))  # 18 tokens: 5 blocks of 4
PARAMS = m.Params(max_tokens=5, ignore_eos=True)
BLOCKS = 12  # of the decode worker: 4 tokens x 2 layers x K, V x 2 heads x 16 x float32 each
KV_GB = BLOCKS * 4 * 2 * 2 * 2 * 16 * 4 / (1 << 30)


@pytest.fixture(scope="module")
def files():
    return make_model_files(seed=3)


@pytest.fixture(scope="module")
def reference(files):
    engine = make_engine(files)
    return run_to_completion(engine, [PROMPT], SamplingParams(max_tokens=5, ignore_eos=True))[0]


@pytest.fixture
def pair(files):
    """(decode side, its sent messages, prefill side, its sent messages)."""
    d_engine = make_engine(files, role="decode", kv_cache_gb=KV_GB)
    p_engine = make_engine(files, role="prefill")
    assert d_engine.block_manager.num_blocks == BLOCKS
    layout = layout_of(d_engine.fingerprint, d_engine.runner.k_caches)
    receiver = make_receiver("inproc", layout, d_engine.runner.k_caches, d_engine.runner.v_caches)
    receiver.start()
    sender = make_sender("inproc", layout, p_engine.runner.k_caches, p_engine.runner.v_caches)
    d_sent, p_sent = [], []
    decode = DecodeSide(d_engine, layout, d_sent.append, "d0", receiver)
    prefill = PrefillSide(p_engine, sender, p_sent.append, transfer_timeout_s=10)
    d_engine.connect(decode)
    p_engine.connect(prefill)
    yield decode, d_sent, prefill, p_sent
    receiver.close()
    sender.close()


def _prefill(prefill: PrefillSide, sent: list, placement: m.Placement) -> m.PrefillDone:
    prefill.on_prefill(
        m.Prefill(placement.request_id, PROMPT, PARAMS, placement.kv_endpoints,
                  placement.block_ids, placement.num_cached_tokens)
    )  # fmt: skip
    engine = prefill.engine
    while engine.has_work():
        prefill.finish(engine.step())
    while prefill.pushing:
        prefill.wait_settle(0.05)
    [done] = sent
    return done


def _decode_all(decode: DecodeSide, sent: list) -> list[m.TokenOut]:
    while decode.engine.has_work():
        decode.emit(decode.engine.step())
    return [item for msg in sent if isinstance(msg, m.Tokens) for item in msg.items]


def _clean(engine) -> None:
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_remote_prefill_handoff_gives_the_offline_tokens_and_frees_every_block(pair, reference):
    decode, d_sent, prefill, p_sent = pair
    decode.on_admit(m.Admit("r0", PROMPT, PARAMS, remote_prefill=True, lease_s=60))
    [placement] = d_sent
    assert placement.request_id == "r0" and len(placement.block_ids) == 5
    assert "r0" in decode.leases and decode.engine.stats()["transferring"] == 1
    done = _prefill(prefill, p_sent, placement)
    assert done.first_token == reference[0] and done.error is None and done.transfer_bytes > 0
    _clean(prefill.engine)  # the prefill worker freed its blocks once the push was acknowledged
    d_sent.clear()
    decode.on_kv_ready(m.KVReady("r0", done.first_token))
    items = _decode_all(decode, d_sent)
    assert [i.index for i in items] == [0, 1, 2, 3, 4]
    assert [i.token for i in items] == reference and items[-1].finish_reason == "length"
    assert not decode.leases and not decode.index_offset and not decode.landing
    _clean(decode.engine)


def test_kv_ready_without_a_first_token_prefills_locally_with_the_same_tokens(pair, reference):
    decode, d_sent, _, _ = pair
    decode.on_admit(m.Admit("r0", PROMPT, PARAMS, remote_prefill=True, lease_s=60))
    decode.on_kv_ready(m.KVReady("r0", None))  # the prefill failed
    assert not decode.leases
    assert [i.token for i in _decode_all(decode, d_sent)] == reference
    decode.on_kv_ready(m.KVReady("r0", 5))  # a late duplicate is ignored
    _clean(decode.engine)


def test_kv_ready_with_layers_missing_prefills_locally(pair, reference):
    decode, d_sent, _, _ = pair
    decode.on_admit(m.Admit("r0", PROMPT, PARAMS, remote_prefill=True, lease_s=60))
    decode.on_kv_ready(m.KVReady("r0", 7))  # claims a token, but no layer ever landed
    assert [i.token for i in _decode_all(decode, d_sent)] == reference
    _clean(decode.engine)


def test_an_expired_lease_prefills_locally(pair, reference):
    decode, d_sent, _, _ = pair
    decode.on_admit(m.Admit("r0", PROMPT, PARAMS, remote_prefill=True, lease_s=30))
    decode.expire_leases(time.monotonic() + 10)
    assert "r0" in decode.leases  # not yet
    decode.expire_leases(time.monotonic() + 31)
    assert not decode.leases
    assert [i.token for i in _decode_all(decode, d_sent)] == reference
    decode.on_kv_ready(m.KVReady("r0", 7))  # the prefill worker's late answer: ignored
    _clean(decode.engine)


def test_placement_waits_for_free_blocks_oldest_first(pair):
    decode, d_sent, _, _ = pair
    bm = decode.engine.block_manager
    hog = list(range(100, 100 + 4 * (bm.num_blocks - 3)))  # leaves 3 blocks: too few for 5
    assert bm.num_blocks == BLOCKS
    decode.on_admit(m.Admit("hog", hog, m.Params(max_tokens=1), remote_prefill=True, lease_s=60))
    decode.on_admit(m.Admit("r0", PROMPT, PARAMS, remote_prefill=True, lease_s=60))
    decode.on_admit(m.Admit("r1", PROMPT, PARAMS, remote_prefill=True, lease_s=60))
    assert [p.request_id for p in d_sent] == ["hog"]
    assert [a.request_id for a in decode.pending] == ["r0", "r1"]
    decode.abort("hog")
    decode.engine.abort("hog")
    decode.try_place()
    assert [p.request_id for p in d_sent] == ["hog", "r0", "r1"] and not decode.pending
    for rid in ("r0", "r1"):
        decode.abort(rid)
        decode.engine.abort(rid)
    _clean(decode.engine)


def test_a_migrated_request_numbers_its_tokens_after_those_already_streamed(pair, reference):
    decode, d_sent, _, _ = pair
    replay = PROMPT + reference[:2]  # the client has the first two tokens
    params = m.Params(max_tokens=3, ignore_eos=True)
    decode.on_admit(m.Admit("r0", replay, params, remote_prefill=False, lease_s=60, skip_tokens=2))
    items = _decode_all(decode, d_sent)
    assert [i.index for i in items] == [2, 3, 4]
    assert [i.token for i in items] == reference[2:]
    _clean(decode.engine)


def test_an_aborted_push_frees_the_prefill_workers_blocks(pair):
    _, _, prefill, p_sent = pair
    prefill.on_prefill(m.Prefill("r0", PROMPT, PARAMS, "inproc://nowhere", list(range(5)), 0))
    assert prefill.request_ids == {"r0"}
    prefill.abort("r0")
    prefill.engine.abort("r0")
    assert not prefill.request_ids and not prefill.engine.has_work() and not p_sent
    _clean(prefill.engine)


def _compute(prefill: PrefillSide, rid: str, placement: m.Placement) -> None:
    prefill.on_prefill(
        m.Prefill(rid, PROMPT, PARAMS, placement.kv_endpoints, placement.block_ids, 0)
    )
    while prefill.engine.has_work():
        prefill.finish(prefill.engine.step())


def test_a_push_that_is_never_acknowledged_holds_only_its_own_request(pair, files, reference):
    """A decode worker that stops taking a push (here: a push delayed 60 s) costs that request
    the transfer timeout; a prompt for another decode worker is computed, pushed and reported
    meanwhile, and the stuck one ends with an error and frees its blocks."""
    decode, d_sent, prefill, p_sent = pair
    prefill.transfer_timeout_s = 1.0
    prefill.sender.faults = FaultPlan(delay_s=60, transfer_ids=frozenset({"stuck"}))
    other_engine = make_engine(files, role="decode", kv_cache_gb=KV_GB)
    other_rx = make_receiver("inproc", decode.layout, other_engine.runner.k_caches,
                             other_engine.runner.v_caches)  # fmt: skip
    other_rx.start()
    other_sent = []
    other = DecodeSide(other_engine, decode.layout, other_sent.append, "d1", other_rx)
    other_engine.connect(other)
    try:
        decode.on_admit(m.Admit("stuck", PROMPT, PARAMS, remote_prefill=True, lease_s=60))
        other.on_admit(m.Admit("fast", PROMPT, PARAMS, remote_prefill=True, lease_s=60))
        _compute(prefill, "stuck", d_sent[0])
        assert "stuck" in prefill.pushing and not p_sent  # its push waits for acknowledgement
        _compute(prefill, "fast", other_sent[0])
        while not p_sent:
            prefill.wait_settle(0.05)
        [done] = p_sent
        assert (done.request_id, done.first_token, done.error) == ("fast", reference[0], None)
        assert "stuck" in prefill.pushing  # not given up yet: the timeout is 1 s
        while prefill.pushing:
            prefill.wait_settle(0.05)
        stuck = p_sent[1]
        assert stuck.request_id == "stuck" and stuck.first_token is None
        assert stuck.error.startswith("timed out after 1 s")
        _clean(prefill.engine)
    finally:
        other_rx.close()


def test_aborting_a_request_whose_push_is_in_flight_frees_its_blocks(pair):
    decode, d_sent, prefill, p_sent = pair
    prefill.sender.faults = FaultPlan(delay_s=60)
    decode.on_admit(m.Admit("r0", PROMPT, PARAMS, remote_prefill=True, lease_s=60))
    _compute(prefill, "r0", d_sent[0])
    assert "r0" in prefill.pushing
    prefill.abort("r0")  # the worker's abort: the side first, then the engine
    prefill.engine.abort("r0")
    assert not prefill.request_ids and not p_sent
    _clean(prefill.engine)


def test_aborting_a_request_between_its_chunks_cancels_the_layers_it_queued(pair):
    """An abort between a prompt's chunks, once the first chunk's layers are queued for the
    decode worker: the transfer ends on the sender (counted failed, nothing left open) before
    the engine frees the blocks those layers are read from."""
    decode, d_sent, prefill, p_sent = pair
    prefill.sender.faults = FaultPlan(delay_s=60)
    prefill.engine.scheduler.token_budget = prefill.engine.scheduler.chunk_size = 8
    decode.on_admit(m.Admit("r0", PROMPT, PARAMS, remote_prefill=True, lease_s=60))
    [placement] = d_sent
    prefill.on_prefill(
        m.Prefill("r0", PROMPT, PARAMS, placement.kv_endpoints, placement.block_ids, 0)
    )
    prefill.finish(prefill.engine.step())  # the first 8 of 18 tokens: 2 blocks queued
    assert "r0" in prefill.outgoing and not prefill.sender.settled("r0")
    prefill.abort("r0")
    prefill.engine.abort("r0")
    assert prefill.sender.settled("r0") and prefill.sender.stats().failures == 1
    assert not prefill.request_ids and not p_sent
    _clean(prefill.engine)


@pytest.fixture
def spans():
    """Tracing on in this process, into the SDK's in-memory exporter."""
    memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
    exporter = memory.InMemorySpanExporter()
    tracing.setup("pdserve-test", exporter=exporter)
    yield exporter
    tracing.disable()


TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_traced_handoff_records_each_sides_phases_under_the_routers_span(pair, spans):
    decode, d_sent, prefill, p_sent = pair
    decode.store = types.SimpleNamespace(lookups={"r0": (16, 8)})  # what a store link kept
    decode.on_admit(m.Admit("r0", PROMPT, PARAMS, True, 60, trace=TRACE))
    [placement] = d_sent
    prefill.on_prefill(
        m.Prefill("r0", PROMPT, PARAMS, placement.kv_endpoints, placement.block_ids,
                  placement.num_cached_tokens, trace=TRACE)
    )  # fmt: skip
    while prefill.engine.has_work():
        prefill.finish(prefill.engine.step())
    while prefill.pushing:
        prefill.wait_settle(0.05)
    [done] = p_sent
    assert done.queue_s >= 0 and done.compute_s > 0
    decode.on_kv_ready(m.KVReady("r0", done.first_token))
    _decode_all(decode, d_sent)
    got = {s.name: s for s in spans.get_finished_spans()}
    assert set(got) == {"prefill.queue", "prefill.compute", "prefill.kv_push",
                        "decode.kv_wait", "decode.first_token", "decode.decode"}  # fmt: skip
    for s in got.values():  # all under the router's span of the traceparent
        assert s.context.trace_id == int(TRACE[3:35], 16)
        assert s.parent.span_id == int("00f067aa0ba902b7", 16)
    assert got["prefill.kv_push"].attributes["pdserve.bytes"] == done.transfer_bytes > 0
    assert got["prefill.compute"].end_time <= got["prefill.kv_push"].end_time
    assert got["decode.kv_wait"].attributes["pdserve.complete"] is True
    [hit] = got["decode.first_token"].events
    assert hit.name == "kv_store_hit" and hit.attributes["pdserve.hit_tokens"] == 8
    assert got["decode.decode"].attributes["pdserve.output_tokens"] == 5
    assert not decode.traced and not decode.store.lookups


def test_an_expired_traced_lease_records_the_fallback(pair, spans):
    decode, d_sent, _, _ = pair
    decode.on_admit(m.Admit("r0", PROMPT, PARAMS, True, 0.01, trace=TRACE))
    decode.expire_leases(time.monotonic() + 1)
    assert decode.leases_expired == 1
    _decode_all(decode, d_sent)
    got = {s.name: s for s in spans.get_finished_spans()}
    [fallback] = got["decode.kv_wait"].events
    assert fallback.name == "fallback_local_prefill"
    assert fallback.attributes["pdserve.why"] == "lease expired"
    assert got["decode.first_token"].attributes["pdserve.local_prefill"] is True
