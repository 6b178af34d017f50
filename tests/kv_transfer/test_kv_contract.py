"""The KVSender/KVReceiver contract, checked identically on every backend."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from pdserve.kv_transfer import make_sender

from .helpers import BACKENDS, make_caches, make_layout

pytestmark = pytest.mark.parametrize("backend", BACKENDS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_landed_bytes_are_bit_identical(backend, dtype, make_pair):
    pair = make_pair(backend, make_layout(dtype))
    rng = random.Random(7)
    src = rng.sample(range(20), 6) + [20, 21, 22]  # random ids plus a run contiguous on both sides
    dst = rng.sample(range(40), 6) + [40, 41, 42]
    pair.receiver.expect("req-1", dst)
    pair.send_all("req-1", src, dst)
    result = pair.sender.wait("req-1", timeout_s=10)
    assert result.ok, result.error
    bytes_expected = 3 * 2 * 9 * pair.layout.block_bytes
    assert result.bytes_sent == bytes_expected
    assert pair.receiver.layers_landed("req-1") == 3
    assert pair.receiver.wait_layer("req-1", 2, timeout_s=1) is True
    assert pair.receiver.failed("req-1") is None
    assert all(pair.landed_equal(layer, src, dst) for layer in range(3))
    others = sorted(set(range(48)) - set(dst))
    assert pair.untouched(others)
    assert pair.sender.stats().bytes == bytes_expected
    assert pair.receiver.stats().bytes == bytes_expected
    assert pair.receiver.stats().transfers == 1


def test_a_latent_cache_moves_one_tensor_per_layer(backend, make_pair):
    """An MLA layout (one latent of one "head" per token and layer, no V): bit-identical
    landing of the latent alone, its blocks' bytes and no more."""
    layout = make_layout(num_kv_heads=1, head_dim=40, cache="latent")
    pair = make_pair(backend, layout)
    assert pair.dst_v == [] and layout.tensors == 1
    src, dst = [3, 4, 5, 9], [10, 11, 12, 0]
    pair.receiver.expect("mla", dst)
    pair.send_all("mla", src, dst)
    result = pair.sender.wait("mla", timeout_s=10)
    assert result.ok, result.error
    assert result.bytes_sent == pair.receiver.stats().bytes == 3 * 4 * (4 * 40 * 4)
    assert all(pair.landed_equal(layer, src, dst) for layer in range(3))
    assert pair.untouched(sorted(set(range(48)) - set(dst)))


def test_two_concurrent_transfers_from_two_senders(backend, make_pair):
    pair = make_pair(backend)
    second = type(pair.sender)(pair.layout, pair.src_k, pair.src_v)  # a second prefill worker
    try:
        jobs = {"a": (pair.sender, [0, 5, 9, 2], [1, 3, 5, 7]), "b": (second, [4, 8, 1, 30],
                [2, 4, 6, 47])}  # fmt: skip
        for tid, (_, _, dst) in jobs.items():
            pair.receiver.expect(tid, dst)
        results = {}

        def run(tid: str) -> None:
            sender, src, dst = jobs[tid]
            for layer in range(3):
                sender.send_layer(pair.receiver.endpoint, tid, layer, src, dst)
            results[tid] = sender.wait(tid, timeout_s=10)

        threads = [threading.Thread(target=run, args=(tid,)) for tid in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[t].ok for t in "ab"] == [True, True], results
        for _, src, dst in jobs.values():
            assert all(pair.landed_equal(layer, src, dst) for layer in range(3))
    finally:
        second.close()


def test_interleaved_transfers_on_one_connection(backend, make_pair):
    pair = make_pair(backend)
    pair.receiver.expect("x", [10, 11])
    pair.receiver.expect("y", [20, 21])
    for layer in range(3):
        pair.sender.send_layer(pair.receiver.endpoint, "x", layer, [0, 1], [10, 11])
        pair.sender.send_layer(pair.receiver.endpoint, "y", layer, [2, 3], [20, 21])
    assert pair.sender.wait("y", 10).ok and pair.sender.wait("x", 10).ok
    assert pair.landed_equal(1, [0, 1], [10, 11]) and pair.landed_equal(2, [2, 3], [20, 21])


def test_layout_mismatch_is_refused_naming_the_fields(backend, make_pair):
    pair = make_pair(backend)
    other = make_layout(block_size=8, dtype="bfloat16")
    k, v = make_caches(other, 4)
    sender = make_sender(backend, other, k, v)
    try:
        pair.receiver.expect("m", [0])
        sender.send_layer(pair.receiver.endpoint, "m", 0, [0], [0])
        result = sender.wait("m", timeout_s=10)
    finally:
        sender.close()
    assert not result.ok
    assert "block_size: decode worker has 4, prefill worker has 8" in result.error
    assert "dtype: decode worker has 'float32', prefill worker has 'bfloat16'" in result.error
    assert "num_kv_heads" not in result.error
    assert pair.untouched([0])


def test_unregistered_blocks_are_refused(backend, make_pair):
    pair = make_pair(backend)
    pair.receiver.expect("r", [1, 2])
    pair.send_all("r", [0, 1], [1, 3])  # block 3 belongs to nobody
    result = pair.sender.wait("r", timeout_s=10)
    assert not result.ok
    assert "refused layer 0 of 'r': blocks [3] are not registered" in result.error
    assert pair.receiver.failed("r") == result.error
    assert pair.untouched([1, 2, 3])
    pair.send_all("nobody", [0], [5], layers=[0])
    result = pair.sender.wait("nobody", timeout_s=10)
    assert result.error == "transfer 'nobody' is not expected by this receiver"
    assert pair.untouched([5])


def test_blocks_of_another_live_transfer_cannot_be_expected(backend, make_pair):
    pair = make_pair(backend)
    pair.receiver.expect("a", [1, 2])
    with pytest.raises(ValueError, match=r"blocks \[2\] are still registered"):
        pair.receiver.expect("b", [2, 3])
    with pytest.raises(ValueError, match="outside"):
        pair.receiver.expect("c", [48])
    with pytest.raises(ValueError, match="repeat"):
        pair.receiver.expect("c", [4, 4])
    pair.receiver.release("a")
    pair.receiver.expect("b", [2, 3])  # free again after release


def test_release_means_no_later_write(backend, make_pair):
    layout = make_layout(num_layers=8, block_size=64, num_kv_heads=4, head_dim=64)  # 64 KiB/block
    pair = make_pair(backend, layout, src_blocks=24, dst_blocks=24)
    ids = list(range(24))
    pair.receiver.expect("gone", ids)
    pair.send_all("gone", ids, ids)
    assert pair.receiver.wait_layer("gone", 0, timeout_s=10)
    pair.receiver.release("gone")  # while later layers are still on their way
    after_release = pair.snapshot()
    result = pair.sender.wait("gone", timeout_s=10)
    assert all(torch.equal(a, b) for a, b in zip(after_release, pair.snapshot(), strict=True))
    if not result.ok:  # unless every layer had landed before the release
        assert "released by the receiver" in result.error
    pair.send_all("gone", ids, ids, layers=[7])  # late data for the released id
    late = pair.sender.wait("gone", timeout_s=10)
    assert late.error == "transfer 'gone' was released by the receiver (lease expired or aborted)"
    assert all(torch.equal(a, b) for a, b in zip(after_release, pair.snapshot(), strict=True))
    with pytest.raises(KeyError):
        pair.receiver.layers_landed("gone")


def test_wait_layer_times_out_and_empty_transfer_is_complete(backend, make_pair):
    pair = make_pair(backend)
    pair.receiver.expect("slow", [1])
    assert pair.receiver.wait_layer("slow", 0, timeout_s=0.05) is False
    assert pair.receiver.layers_landed("slow") == 0
    pair.receiver.expect("cached", [])  # fully prefix-cached prompt: nothing to receive
    assert pair.receiver.layers_landed("cached") == 3
    assert pair.sender.wait("never-sent", timeout_s=1).ok


def test_close_endpoint_fails_queued_layers_and_reconnects_later(backend, make_pair):
    pair = make_pair(backend)
    pair.receiver.expect("a", [1])
    pair.sender.close_endpoint(pair.receiver.endpoint)  # nothing open yet: a no-op
    pair.send_all("a", [1], [1])
    assert pair.sender.wait("a", 10).ok
    pair.sender.close_endpoint(pair.receiver.endpoint)
    pair.receiver.expect("b", [2])
    pair.send_all("b", [2], [2])  # a fresh channel and connection
    assert pair.sender.wait("b", 10).ok and pair.landed_equal(2, [2], [2])
