"""StoreClient against an in-process server: bit-identical round trips, prefixes, verification,
over both transports (nixl: block bytes by NIXL READs, see pdserve/kv_store/nixl.py)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from kv_transfer.helpers import SENTINEL

from pdserve.kv_store.client import CHUNK, LayerLoad
from pdserve.kv_store.ssd import SsdFiles

from .helpers import TRANSPORTS, make_caches, make_chain, make_config, make_layout

pytestmark = pytest.mark.parametrize("transport", TRANSPORTS)


def _same(src, dst, src_ids, dst_ids) -> bool:
    """Blocks dst_ids of the destination caches equal blocks src_ids of the source, bit for bit."""
    return all(
        torch.equal(d[layer][dst_ids].view(torch.uint8), s[layer][src_ids].view(torch.uint8))
        for s, d in zip(src, dst, strict=True)
        for layer in range(len(s))
    )


def _untouched(caches, ids) -> bool:
    return all(bool((t[ids] == SENTINEL).all()) for side in caches for t in side)


def _put(client, chain, ids, parent=None) -> None:
    ticket = client.put(chain.hashes, chain.tokens, ids, parent=parent)
    assert ticket.wait(10) and ticket.ok, ticket.error


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tier", ["dram", "ssd"])
def test_round_trip_is_bit_identical(serve, client, dtype, tier, transport):
    layout = make_layout(dtype)
    served = serve(layout, dram_blocks=16 if tier == "dram" else 0, ssd_blocks=16)
    assert served.server.endpoint.startswith(f"{transport}://")
    src, dst = make_caches(layout, 12, seed=7), make_caches(layout, 12, seed=None)
    writer = client(served.server.endpoint, layout, *src)
    reader = client(served.server.endpoint, layout, *dst)
    chain = make_chain(6)
    src_ids, dst_ids = [4, 5, 6, 0, 11, 2], [9, 3, 10, 11, 0, 1]
    _put(writer, chain, src_ids)
    assert reader.load(chain.hashes, dst_ids, token_ids_per_block=chain.tokens) == 6
    assert _same(src, dst, src_ids, dst_ids)
    assert _untouched(dst, [2, 4, 5, 6, 7, 8])
    s = reader.stats()  # on the load's connection: served after the load was accounted
    assert (s.hits_dram, s.hits_ssd, s.misses) == ((6, 0, 0) if tier == "dram" else (0, 6, 0))
    assert s.bytes_in == s.bytes_out == 6 * 2 * layout.num_layers * layout.block_bytes
    if transport == "nixl":  # the DRAM tier's blocks live in the store's registered memory
        assert served.server.nixl.arena.live_slots == s.dram_blocks


def test_lookup_counts_the_longest_held_prefix(serve, client):
    layout = make_layout()
    served = serve(layout)
    c = client(served.server.endpoint, layout, *make_caches(layout, 8))
    chain = make_chain(8)
    _put(c, make_chain(5), [0, 1, 2, 3, 4])
    assert c.lookup(chain.hashes) == 5
    assert c.lookup(chain.hashes[:3]) == 3
    assert c.lookup([chain.hashes[0], chain.hashes[1], 12345, chain.hashes[3]]) == 2
    assert c.lookup(chain.hashes[1:]) == 4  # the store holds blocks, not only whole chains
    assert c.lookup([]) == 0
    other = make_layout("bfloat16")  # same hashes, other layout: other keys
    assert client(served.server.endpoint, other, *make_caches(other, 2)).lookup(chain.hashes) == 0


def test_load_returns_the_prefix_held_and_leaves_the_rest(serve, client):
    layout = make_layout()
    served = serve(layout)
    src, dst = make_caches(layout, 8, seed=2), make_caches(layout, 8, seed=None)
    _put(client(served.server.endpoint, layout, *src), make_chain(3), [0, 1, 2])
    reader = client(served.server.endpoint, layout, *dst)
    assert reader.load(make_chain(5).hashes, [3, 4, 5, 6, 7]) == 3
    assert _same(src, dst, [0, 1, 2], [3, 4, 5]) and _untouched(dst, [0, 1, 2, 6, 7])
    assert reader.stats().misses == 2
    assert reader.last_error is None


def test_a_load_on_its_own_thread_reports_each_layer_as_it_lands(serve, client, transport):
    layout = make_layout()
    served = serve(layout)
    src, dst = make_caches(layout, 8, seed=2), make_caches(layout, 8, seed=None)
    _put(client(served.server.endpoint, layout, *src), make_chain(3), [0, 1, 2])
    reader = client(served.server.endpoint, layout, *dst)
    seen = []
    real_on_layer = LayerLoad.layer_done

    def spy(job, layer):  # what had landed when the client said layer `layer` was done
        seen.append((layer, _same_layers(src, dst, [0, 1, 2], [5, 6, 7], layer + 1)))
        real_on_layer(job, layer)

    LayerLoad.layer_done = spy
    try:
        job = reader.start_load(make_chain(4).hashes, [5, 6, 7, 4])
        job.wait_layer(layout.num_layers - 1)
        assert job.result() == 3  # the store holds 3 of the 4
    finally:
        LayerLoad.layer_done = real_on_layer
    if transport == "tcp":  # in order, each only once its K and V are in place
        assert seen == [(i, True) for i in range(layout.num_layers)]
    else:  # NIXL READs all layers at once: only the result says so
        assert seen == []
    assert _same(src, dst, [0, 1, 2], [5, 6, 7]) and _untouched(dst, [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="destination blocks"):
        reader.start_load(make_chain(2).hashes, [1])  # a caller bug: at once, no thread


def _same_layers(src, dst, src_ids, dst_ids, layers: int) -> bool:
    return all(
        torch.equal(d[layer][dst_ids], s[layer][src_ids])
        for s, d in zip(src, dst, strict=True)
        for layer in range(layers)
    )


def test_load_verifies_token_ids_and_the_chain(serve, client):
    layout = make_layout()
    served = serve(layout)
    src, dst = make_caches(layout, 4, seed=2), make_caches(layout, 4, seed=None)
    chain = make_chain(3)
    _put(client(served.server.endpoint, layout, *src), chain, [0, 1, 2])
    reader = client(served.server.endpoint, layout, *dst)
    wrong = [chain.tokens[0], [9, 9, 9, 9], chain.tokens[2]]
    assert reader.load(chain.hashes, [1, 2, 3], token_ids_per_block=wrong) == 1
    assert "failed verification" in reader.last_error
    assert _same(src, dst, [0], [1]) and _untouched(dst, [0, 2, 3])
    # the tail of a chain loads when its parent is named, and not as the start of a sequence
    assert reader.load(chain.hashes[1:], [2, 3]) == 0
    assert reader.load(chain.hashes[1:], [2, 3], parent=chain.hashes[0]) == 2
    assert _same(src, dst, [1, 2], [2, 3])


def test_put_skips_blocks_the_store_holds(serve, client):
    layout = make_layout()
    served = serve(layout)
    c = client(served.server.endpoint, layout, *make_caches(layout, 8))
    chain = make_chain(4)
    first = c.put(chain.hashes[:2], chain.tokens[:2], [0, 1])
    second = c.put(chain.hashes, chain.tokens, [0, 1, 2, 3])
    assert c.flush(10)
    assert (first.stored, second.stored, second.ok) == (2, 2, True)
    s = served.store.stats()
    assert (s.blocks_put, s.blocks_put_duplicate, s.bytes_in) == (
        4, 0, 4 * 2 * layout.num_layers * layout.block_bytes)  # fmt: skip


def test_put_rejects_caller_bugs_at_once(serve, client):
    layout = make_layout()
    c = client(serve(layout).server.endpoint, layout, *make_caches(layout, 4))
    chain = make_chain(2)
    with pytest.raises(ValueError, match="not the chained hash"):
        c.put(chain.hashes[1:], chain.tokens[1:], [0])  # its parent is not None
    with pytest.raises(ValueError, match="outside"):
        c.put(chain.hashes, chain.tokens, [0, 4])
    with pytest.raises(ValueError, match="2 block ids for 1"):
        c.put(chain.hashes[:1], chain.tokens[:1], [0, 1])
    with pytest.raises(ValueError, match="repeat"):
        c.load(chain.hashes, [1, 1])


def test_requests_larger_than_one_message_are_split(serve, client):
    layout = make_layout(num_layers=1)
    n = CHUNK + 44
    served = serve(layout, dram_blocks=n, ssd_blocks=0)
    src, dst = make_caches(layout, n, seed=3), make_caches(layout, n, seed=None)
    chain = make_chain(n)
    _put(client(served.server.endpoint, layout, *src), chain, list(range(n)))
    reader = client(served.server.endpoint, layout, *dst)
    assert reader.lookup(chain.hashes) == n
    assert reader.load(chain.hashes, list(reversed(range(n)))) == n
    assert _same(src, dst, list(range(n)), list(reversed(range(n))))


def test_a_corrupt_ssd_file_ends_the_loaded_prefix(serve, client, tmp_path):
    layout = make_layout()
    served = serve(layout, config=make_config(tmp_path, layout, 0, 8))
    src, dst = make_caches(layout, 4, seed=5), make_caches(layout, 4, seed=None)
    chain = make_chain(4)
    _put(client(served.server.endpoint, layout, *src), chain, [0, 1, 2, 3])
    path = SsdFiles(tmp_path).path(served.store.tier_keys()[1][2])
    data = bytearray(path.read_bytes())
    data[-40] ^= 1  # the last payload byte
    path.write_bytes(bytes(data))
    reader = client(served.server.endpoint, layout, *dst)
    assert reader.load(chain.hashes, [0, 1, 2, 3]) == 2
    assert _same(src, dst, [0, 1], [0, 1]) and _untouched(dst, [2, 3])
    assert served.store.stats().corrupt_dropped == 1
    assert reader.lookup(chain.hashes) == 2
    assert not path.exists()


def test_lookup_lease_pins_until_the_next_request(serve, client):
    layout = make_layout()
    served = serve(layout)
    c = client(served.server.endpoint, layout, *make_caches(layout, 4))
    chain = make_chain(3)
    _put(c, chain, [0, 1, 2])
    assert c.lookup(chain.hashes + [42], pin_s=30) == 3
    assert served.store.stats().pinned_blocks == 3
    assert c.stats().pinned_blocks == 0  # the next request ended the lease
    assert c.lookup(chain.hashes, pin_s=30) == 3
    c.close()  # a closed connection ends its lease too
    served.server.close()
    assert served.store.stats().pinned_blocks == 0


def test_puts_after_close_fail_at_once(serve, client):
    layout = make_layout()
    c = client(serve(layout).server.endpoint, layout, *make_caches(layout, 2))
    c.close()
    ticket = c.put(make_chain(1).hashes, make_chain(1).tokens, [0])
    assert ticket.done() and ticket.error == "KV store client closed"
    assert c.flush(0)


def test_clients_hear_of_the_stores_evictions_in_their_replies(serve, client):
    layout = make_layout()
    served = serve(layout, dram_blocks=2, ssd_blocks=0)  # a third block evicts the first
    chain = make_chain(3)
    writer = client(served.server.endpoint, layout, *make_caches(layout, 4))
    watcher = client(served.server.endpoint, layout, *make_caches(layout, 4))
    assert watcher.lookup([1]) == 0  # its connection is open before the eviction
    _put(writer, chain, [0, 1, 2])
    assert writer.drain_removed() == [chain.hashes[0]]  # in the PutReply of the evicting put
    assert writer.drain_removed() == []
    assert watcher.lookup(chain.hashes) == 0 and watcher.drain_removed() == [chain.hashes[0]]
    latecomer = client(served.server.endpoint, layout, *make_caches(layout, 4))
    assert latecomer.lookup(chain.hashes) == 0 and latecomer.drain_removed() == []
    other = make_layout("bfloat16")  # hears nothing of another layout's blocks
    stranger = client(served.server.endpoint, other, *make_caches(other, 2))
    assert stranger.lookup([1]) == 0
    _put(writer, make_chain(2, first_token=500), [0, 1])  # evicts chain's blocks 1 and 2
    assert stranger.lookup([1]) == 0 and stranger.drain_removed() == []
    assert writer.drain_removed() == chain.hashes[1:]


def test_copied_blocks_round_trip_after_the_cache_block_is_reused(serve, client):
    layout = make_layout()
    served = serve(layout)
    src, dst = make_caches(layout, 4, seed=4), make_caches(layout, 4, seed=None)
    before = make_caches(layout, 4, seed=4)  # the same values, kept aside
    c = client(served.server.endpoint, layout, *src)
    chain = make_chain(2)
    copies = [c.snapshot(3), c.snapshot(1)]
    for t in (*src[0], *src[1]):
        t[[3, 1]] = 0.0  # the blocks are reused at once: their bytes were copied
    ticket = c.put_copies(chain.metas(), copies)
    assert ticket.wait(10) and ticket.ok and ticket.stored == 2, ticket.error
    reader = client(served.server.endpoint, layout, *dst)
    assert reader.load(chain.hashes, [0, 2], token_ids_per_block=chain.tokens) == 2
    assert _same(before, dst, [3, 1], [0, 2])
    with pytest.raises(ValueError, match="does not match its token ids"):
        c.put_copies([msgspec.structs.replace(chain.metas()[1], parent=None)], copies[:1])
    with pytest.raises(ValueError, match="a payload of 3 bytes"):
        c.put_copies(chain.metas()[:1], [bytearray(3)])
