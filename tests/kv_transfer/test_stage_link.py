"""A pipeline stage's own KV push (`kv_transfer/stage_link.py`), both ends in this process over
the real tcp connector and a real control connection: stage 0's `StageLink` only records a
push (it travels down the pipeline with its step) until the stage queues it on its own sender;
the transfer's end, its bytes and the stage's counters come back over the control connection;
a cancel drops the pushes still on their way; a wrong token is refused; a lost stage fails the
transfers still open. (Through real stage processes: tests/serving/test_pp_disaggregated.py.)"""

from __future__ import annotations

import socket

import pytest
import torch

from pdserve.kv_transfer import make_receiver, make_sender
from pdserve.kv_transfer.stage_link import StageLink, StageLinkServer, stage_caches

from .helpers import make_caches, make_layout

HELD = range(1, 3)  # this stage holds layers 1 and 2 of 3
IDS = [2, 5]


@pytest.fixture
def stage():
    """(receiver, the stage's server, stage 0's link, the pushes on their way down)."""
    layout = make_layout()
    dst_k, dst_v = make_caches(layout, 8, seed=None)
    receiver = make_receiver("tcp", layout, dst_k, dst_v)
    receiver.start()
    src_k, src_v = make_caches(layout, 8, seed=1)
    server = StageLinkServer(make_sender("tcp", layout, *stage_caches(src_k, src_v, HELD)),
                             "127.0.0.1")  # fmt: skip
    outbox = []
    link = StageLink(1, server.address, outbox.append, num_blocks=8)
    yield receiver, server, link, outbox, (src_k, src_v, dst_k, dst_v)
    link.close()
    server.close()
    receiver.close()


def send(link, receiver, tid: str) -> None:
    receiver.expect(tid, IDS)
    for layer in HELD:
        link.send_layer(receiver.endpoint, tid, layer, IDS, IDS)


def test_pushes_wait_for_the_stage_then_land_and_report_back(stage):
    receiver, server, link, outbox, (src_k, src_v, dst_k, dst_v) = stage
    send(link, receiver, "t")
    assert len(outbox) == 2 and receiver.layers_landed("t") == 0  # only recorded
    server.push(outbox)  # the stage computed its layers
    result = link.wait("t", 10)
    block = 2 * make_layout().block_bytes * len(IDS)  # K and V of the blocks, one layer
    assert (result.ok, result.bytes_sent) == (True, 2 * block)
    assert (link.stats().bytes, link.stats().layers) == (2 * block, 2)
    for layer in HELD:
        assert torch.equal(dst_k[layer][IDS], src_k[layer][IDS])
        assert torch.equal(dst_v[layer][IDS], src_v[layer][IDS])
    assert receiver.layers_landed("t") == 2


def test_a_cancel_drops_the_pushes_still_on_their_way(stage):
    receiver, server, link, outbox, _ = stage
    send(link, receiver, "c")
    result = link.cancel("c", "request aborted")  # answered by the stage
    server.push(outbox)  # the step reaches the stage after the cancel
    assert link.wait("c", 0.5).bytes_sent == 0 and result.bytes_sent == 0
    assert server.sender.stats().layers == 0 and receiver.layers_landed("c") == 0
    receiver.release("c")
    send(link, receiver, "next")  # the link still works
    server.push(outbox[2:])
    assert link.wait("next", 10).ok
    assert server.sender.stats().layers == 2  # next's alone (c's would have gone before it)


def test_a_cancelled_transfer_id_used_again_is_pushed(stage):
    """A request id can come again after its transfer was cancelled (a request prefilled here
    once more): only the cancelled attempt's pushes are dropped, the new attempt's land, even
    when the old ones reach the stage after the new ones were recorded."""
    receiver, server, link, outbox, _ = stage
    send(link, receiver, "again")
    assert link.cancel("again", "request aborted").bytes_sent == 0
    receiver.release("again")
    send(link, receiver, "again")  # the same id: a new attempt
    server.push(outbox)  # the cancelled attempt's 2 pushes, then the new one's 2
    result = link.wait("again", 10)
    assert result.ok and result.bytes_sent > 0
    assert server.sender.stats().layers == 2 and receiver.layers_landed("again") == 2


def test_a_push_with_bad_block_ids_is_refused_when_it_is_recorded(stage):
    """As any sender's `send_layer`: bad ids raise now, in stage 0, not later in the stage."""
    receiver, _, link, outbox, _ = stage
    with pytest.raises(ValueError, match="2 source blocks but 1 destination"):
        link.send_layer(receiver.endpoint, "bad", 1, [2, 5], [2])
    with pytest.raises(ValueError, match=r"source block ids \[8\] are outside \[0, 8\)"):
        link.send_layer(receiver.endpoint, "bad", 1, [2, 8], [2, 5])
    assert outbox == []


def test_only_a_connection_with_the_token_gets_in():
    layout = make_layout()
    server = StageLinkServer(make_sender("tcp", layout, *make_caches(layout, 4)), "127.0.0.1")
    where = (server.address.host, server.address.port)
    try:
        with socket.create_connection(where, timeout=5) as s:
            s.sendall(b"x" * len(server.address.token))
            assert s.recv(1) == b""  # closed on it
        link = StageLink(1, server.address, lambda push: None, num_blocks=8)
        assert link.wait("unknown", 5).ok  # answered: the link is in
        with pytest.raises(OSError):  # and the listener closed behind it
            socket.create_connection(where, timeout=5)
        link.close()
    finally:
        server.close()


def test_a_lost_stage_fails_the_open_transfers_by_name(stage):
    receiver, server, link, outbox, _ = stage
    send(link, receiver, "lost")
    assert link.lost is None
    server.close()
    result = link.wait("lost", 10)
    assert not result.ok and result.error.startswith("pipeline stage 1 is gone")
    assert link.settled("other")  # every later transfer fails at once, nothing hangs
    assert link.lost  # what `PPGroup.check` turns into StageLost: the worker is restarted
    link.close()
    assert link.lost is None  # closed on purpose: not lost


def test_stage_caches_stand_in_its_first_layer_for_the_others():
    k = [torch.zeros(0), torch.ones(2), torch.full((2,), 2.0)]
    got_k, got_v = stage_caches(k, [], HELD)
    assert got_k[0] is k[1] and got_k[1:] == k[1:] and got_v == []
