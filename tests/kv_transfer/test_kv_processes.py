"""Real two-process transfers: the receiver lives in a spawned decode-side process."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from pdserve.kv_transfer import make_sender

from .helpers import BACKENDS, make_caches, make_layout, receive_in_child


@pytest.mark.slow
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "inproc"])
def test_transfer_between_two_processes(backend):
    """The child checks, bit for bit, what landed in its blocks and that nothing else changed."""
    layout = make_layout("bfloat16", num_layers=4)
    ctx = mp.get_context("spawn")
    to_child, from_child = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=receive_in_child, args=(backend, layout, to_child, from_child))
    child.start()
    sender = None
    try:
        endpoint = from_child.get(timeout=60)
        sender = make_sender(backend, layout, *make_caches(layout, 16, seed=5))
        src, dst = [3, 9, 4, 5, 15], [30, 2, 11, 12, 7]
        to_child.put(("expect", "p1", dst))
        assert from_child.get(timeout=30) == "ok"
        for layer in range(4):
            sender.send_layer(endpoint, "p1", layer, src, dst)
        result = sender.wait("p1", timeout_s=30)
        assert result.ok, result.error
        assert result.bytes_sent == 4 * 2 * 5 * layout.block_bytes
        to_child.put(("check", "p1", src, dst, 5))
        assert from_child.get(timeout=30) == (4, True, True)
    finally:
        if sender is not None:
            sender.close()
        to_child.put(("stop",))
        child.join(timeout=30)
    assert child.exitcode == 0
