"""Fault injection of the in-process connector, and how each fault looks from both ends."""

from __future__ import annotations

import time

import pytest
import torch
from waiting import wait_until

from pdserve.kv_transfer.inproc import FaultPlan

IDS = [4, 7, 2]
SPARE = 40  # a destination block no test transfer uses


@pytest.fixture
def pair(make_pair):
    p = make_pair("inproc")
    p.receiver.expect("t", IDS)
    return p


def drain(pair) -> None:
    """Wait until the sender has handled every layer queued so far (moved it, or skipped it as
    part of a failed transfer): the channel sends in order, so once a fault-free layer queued
    behind them is acknowledged, none of them can still land."""
    pair.sender.faults = FaultPlan()
    pair.receiver.expect("drain", [SPARE])
    pair.send_all("drain", [0], [SPARE], layers=[0])
    assert pair.sender.wait("drain", 5).ok


def layers_being_sent(pair, transfer_id: str) -> int:
    """Layers of `transfer_id` a channel thread is moving now (read from the sender's tracker:
    the sender has no public way to say)."""
    progress = pair.sender._tracker._progress.get(transfer_id)
    return progress.reading if progress is not None else 0


def test_dropped_layer_is_lost_silently(pair):
    pair.sender.faults = FaultPlan(drop_layers=frozenset({1}))
    pair.send_all("t", IDS, IDS)
    assert pair.sender.wait("t", 5).ok  # the sender cannot tell; the receiver's lease must
    assert pair.receiver.layers_landed("t") == 2
    assert pair.receiver.wait_layer("t", 1, timeout_s=0.05) is False
    assert pair.untouched(IDS, layers=[1])
    assert pair.landed_equal(0, IDS, IDS) and pair.landed_equal(2, IDS, IDS)


def test_failed_layer_is_reported_and_later_layers_are_skipped(pair):
    pair.sender.faults = FaultPlan(fail_layers=frozenset({0}), delay_s=0.01)
    pair.send_all("t", IDS, IDS)
    result = pair.sender.wait("t", 5)
    assert (result.ok, result.error) == (False, "injected fault: layer 0 failed")
    drain(pair)  # the skipped layers would have landed by now
    assert pair.receiver.layers_landed("t") == 0
    assert pair.untouched(IDS)
    assert pair.sender.stats().failures == 1


def test_corrupted_layer_lands_with_the_first_byte_of_each_block_flipped(pair):
    pair.sender.faults = FaultPlan(corrupt_layers=frozenset({2}))
    pair.send_all("t", IDS, IDS)
    assert pair.sender.wait("t", 5).ok
    assert pair.receiver.layers_landed("t") == 3
    assert pair.landed_equal(1, IDS, IDS) and not pair.landed_equal(2, IDS, IDS)
    for src, dst in ((pair.src_k, pair.dst_k), (pair.src_v, pair.dst_v)):
        got = dst[2][IDS].view(torch.uint8).reshape(len(IDS), -1)
        want = src[2][IDS].view(torch.uint8).reshape(len(IDS), -1)
        assert torch.equal(got[:, 0], want[:, 0] ^ 0xFF)
        assert torch.equal(got[:, 1:], want[:, 1:])


def test_delay_and_sender_timeout(pair):
    pair.sender.faults = FaultPlan(delay_s=0.2)
    pair.send_all("t", IDS, IDS)
    t0 = time.monotonic()
    result = pair.sender.wait("t", timeout_s=0.1)
    assert time.monotonic() - t0 < 0.18  # the delayed layer was cut, not waited for
    assert result.error == "timed out after 0.1 s: 0 of 3 layers acknowledged by the receiver"
    drain(pair)  # every layer would have landed by now, had it not been cancelled
    assert pair.receiver.layers_landed("t") == 0
    assert pair.untouched(IDS)


def test_failed_handshake_and_fault_scope(make_pair):
    pair = make_pair("inproc")
    pair.receiver.expect("a", [1])
    pair.receiver.expect("b", [2])
    pair.sender.faults = FaultPlan(fail_layers=frozenset({0}), transfer_ids=frozenset({"a"}))
    pair.send_all("a", [1], [1], layers=[0])
    pair.send_all("b", [2], [2], layers=[0])
    assert not pair.sender.wait("a", 5).ok
    assert pair.sender.wait("b", 5).ok  # faults hit only the listed transfers
    other = make_pair("inproc")
    other.sender.faults = FaultPlan(fail_handshake=True)
    other.receiver.expect("c", [1])
    other.send_all("c", [1], [1], layers=[0])
    error = other.sender.wait("c", 5).error
    assert error.endswith("injected fault: the receiver refused the handshake")


def test_fault_plan_validation():
    with pytest.raises(ValueError, match="delay_s must be >= 0"):
        FaultPlan(delay_s=-1)
    with pytest.raises(TypeError, match="frozenset"):
        FaultPlan(drop_layers={1})


def test_close_endpoint_fails_what_is_still_queued(pair):
    pair.sender.faults = FaultPlan(delay_s=0.3)
    pair.send_all("t", IDS, IDS)
    wait_until(  # layer 0 is in its delay, layers 1 and 2 are queued
        lambda: layers_being_sent(pair, "t") == 1, 5, "layer 0 to be in its delay", interval_s=0.005
    )
    t0 = time.monotonic()
    pair.sender.close_endpoint(pair.receiver.endpoint)
    assert time.monotonic() - t0 < 0.2  # the delayed layer was cut, not waited for
    result = pair.sender.wait("t", 5)
    assert result.error == (f"sending to {pair.receiver.endpoint} failed: aborted while delayed")
    assert pair.receiver.layers_landed("t") == 0 and pair.untouched(IDS)
