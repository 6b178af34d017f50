"""A pipeline-parallel prefill worker's senders (`kv_transfer/stage_senders.py`): each stage's
layers go over that stage's own sender, the receiver counts the transfer complete once every
layer from every stage has landed, each stage's bytes are exactly its layers' share, and a stage
whose push fails fails the transfer with an error that names the stage (in-process connector,
with fault injection)."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer import make_receiver, make_sender
from pdserve.kv_transfer.inproc import FaultPlan
from pdserve.kv_transfer.stage_senders import StageSenders

from .helpers import make_caches, make_layout

IDS = [3, 5, 6]
STAGES = [range(0, 1), range(1, 3)]  # 3 layers: stage 0 holds 1, stage 1 holds 2


@pytest.fixture
def parts():
    layout = make_layout()
    src_k, src_v = make_caches(layout, 16, seed=1)
    dst_k, dst_v = make_caches(layout, 16, seed=None)
    receiver = make_receiver("inproc", layout, dst_k, dst_v)
    receiver.start()
    senders = StageSenders([make_sender("inproc", layout, src_k, src_v) for _ in STAGES], STAGES)
    yield layout, receiver, senders
    senders.close()
    receiver.close()


def push(receiver, senders, tid: str) -> None:
    receiver.expect(tid, IDS)
    for layer in range(3):
        senders.send_layer(receiver.endpoint, tid, layer, IDS, IDS)


def test_each_stage_sends_its_layers_and_the_transfer_completes_on_all(parts):
    layout, receiver, senders = parts
    push(receiver, senders, "t")
    result = senders.wait("t", 5)
    assert result.ok and receiver.layers_landed("t") == 3
    block = 2 * layout.block_bytes * len(IDS)  # K and V of the blocks, one layer
    assert [s.bytes for s in senders.stage_stats()] == [1 * block, 2 * block]
    assert [s.layers for s in senders.stage_stats()] == [1, 2]
    assert result.bytes_sent == 3 * block and senders.settled("t")


def test_a_failing_stage_fails_the_transfer_by_name_and_the_rest_still_lands(parts):
    _, receiver, senders = parts
    senders.senders[1].faults = FaultPlan(fail_layers=frozenset({2}))
    push(receiver, senders, "t")
    result = senders.wait("t", 5)
    assert (result.ok, result.error) == (False, "pipeline stage 1: injected fault: layer 2 failed")
    assert receiver.wait_layer("t", 0, 5)  # stage 0's layer landed; the transfer is incomplete
    assert receiver.layers_landed("t") < 3


def test_a_layer_no_stage_holds_is_refused():
    layout = make_layout()
    k, v = make_caches(layout, 4)
    senders = StageSenders([make_sender("inproc", layout, k, v)], [range(0, 2)])
    try:
        with pytest.raises(ValueError, match="layer 2 is held by no pipeline stage"):
            senders.send_layer("inproc://x", "t", 2, [0], [0])
    finally:
        senders.close()
