"""Which decode-capable worker takes a request: the fewest prompt tokens to compute before its
first token there (queued local prefills + its own uncached ones), then the fewest in flight."""

from __future__ import annotations

import pytest

from pdserve.engine.block_hash import block_hashes
from pdserve.router.placement import NoWorker, pick_decode

from .conftest import load, pending, worker

PROMPT = list(range(1, 201))  # 200 tokens: 12 full blocks of 16


def _colocated(core):
    c = core(mode="colocated", block_size=16)  # (the co-located default is 128)
    for wid in ("a", "b"):
        c.workers[wid] = worker(wid, "both", load())
    return c


def _decoding(core, rid: str, wid: str):
    """A request on `wid` that has its first token (only decoding left)."""
    pending(core, rid, 100, remote=False, decode_id=wid).tokens.append(7)


def test_a_queued_prefill_outweighs_fewer_requests_in_flight(core):
    c = _colocated(core)
    pending(c, "doc", 4000, remote=False, decode_id="a")  # a is prefilling a document
    _decoding(c, "s1", "b")
    _decoding(c, "s2", "b")  # b has more in flight but nothing to prefill
    assert pick_decode(c.view(), PROMPT, 16).worker_id == "b"


def test_with_nothing_queued_the_fewest_in_flight_wins(core):
    c = _colocated(core)
    _decoding(c, "s1", "a")
    assert pick_decode(c.view(), PROMPT, 16).worker_id == "b"
    _decoding(c, "s2", "b")
    _decoding(c, "s3", "b")
    assert pick_decode(c.view(), PROMPT, 16).worker_id == "a"


def test_a_cached_prefix_wins_unless_its_worker_has_more_queued_than_it_saves(core):
    c = _colocated(core)
    c.workers["a"].cached = set(block_hashes(PROMPT, c.config.block_size))  # 192 tokens cached
    _decoding(c, "s1", "a")  # more in flight on a: the cache still decides
    assert pick_decode(c.view(), PROMPT, 16).worker_id == "a"
    pending(c, "q", 150, remote=False, decode_id="a")  # 150 queued + 8 uncached < 200 on b
    assert pick_decode(c.view(), PROMPT, 16).worker_id == "a"
    pending(c, "q2", 100, remote=False, decode_id="a")  # 258 > 200
    assert pick_decode(c.view(), PROMPT, 16).worker_id == "b"


def test_remote_prefills_do_not_count_against_a_decode_worker(core):
    c = core(local_prefill_threshold=256)
    for wid in ("d0", "d1"):
        c.workers[wid] = worker(wid, "decode", load())
    c.workers["p"] = worker("p", "prefill", load())
    pending(c, "doc", 4000, remote=True, decode_id="d0")  # prefilled by the pool
    _decoding(c, "s1", "d1")
    _decoding(c, "s2", "d1")
    assert pick_decode(c.view(), PROMPT, 16).worker_id == "d0"  # fewer in flight


def test_dead_workers_and_prefill_workers_never_decode(core):
    c = _colocated(core)
    c.workers["a"].alive = False
    assert pick_decode(c.view(), PROMPT, 16).worker_id == "b"
    c.workers["b"].alive = False
    c.workers["p"] = worker("p", "prefill", load())
    with pytest.raises(NoWorker):
        pick_decode(c.view(), PROMPT, 16)
