"""The store's index without sockets: LRU demotion and deletion, pins, leases, recovery."""

from __future__ import annotations

import os

import pytest

from pdserve.kv_store.config import Key, layout_key
from pdserve.kv_store.protocol import BlockMeta
from pdserve.kv_store.ssd import SsdFiles
from pdserve.kv_store.store import Store

from .helpers import fill, make_caches, make_chain, make_config, make_layout, payload_of

LAYOUT = make_layout("float32")


def _store(tmp_path, dram, ssd, **kw) -> Store:
    return Store(make_config(tmp_path, LAYOUT, dram, ssd, **kw))


def _read(store: Store, key: Key):
    entries = store.acquire([key])
    try:
        data = store.read(entries[0]) if entries else None
        return None if data is None else bytes(data)
    finally:
        store.release(entries)


def test_lru_demotion_to_ssd_then_deletion_at_ssd_capacity(tmp_path):
    store = _store(tmp_path, dram=3, ssd=4)
    caches = make_caches(LAYOUT, 8, seed=1)
    k = fill(store, LAYOUT, make_chain(8), caches)
    assert store.tier_keys() == ([k[5], k[6], k[7]], [k[1], k[2], k[3], k[4]])
    s = store.stats()
    assert (s.blocks_put, s.demotions, s.evictions_ssd, s.evictions_dram) == (8, 5, 1, 0)
    assert store.contains(k) == [False] + [True] * 7
    # An SSD hit is promoted (keeping its file); DRAM's LRU block 5 is demoted, and SSD's LRU
    # block (2: block 1 was just touched) is deleted to make room for it.
    assert _read(store, k[1]) == payload_of(*caches, 1)
    assert store.tier_keys() == ([k[6], k[7], k[1]], [k[3], k[4], k[1], k[5]])
    assert store.contains(k) == [False, True, False] + [True] * 5
    s = store.stats()
    assert (s.hits_ssd, s.demotions, s.evictions_ssd, s.ssd_blocks, s.dram_blocks) == (
        1, 6, 2, 4, 3)  # fmt: skip
    store.check_integrity()


def test_watermarks_demote_down_to_the_low_mark(tmp_path):
    store = _store(tmp_path, dram=10, ssd=10, high_watermark=0.8, low_watermark=0.5)
    k = fill(store, LAYOUT, make_chain(9), make_caches(LAYOUT, 9))
    # the 9th block passes 8 (high): LRU blocks leave until 5 (low) remain
    assert store.tier_keys() == (k[4:], k[:4])


def test_pinned_blocks_are_never_evicted(tmp_path):
    store = _store(tmp_path, dram=2, ssd=0)  # DRAM only: leaving DRAM means deletion
    a = fill(store, LAYOUT, make_chain(1, first_token=500), make_caches(LAYOUT, 1))
    lease = store.pin_prefix(a, ttl_s=10)
    assert store.stats().pinned_blocks == 1
    b = fill(store, LAYOUT, make_chain(4, first_token=900), make_caches(LAYOUT, 4))
    assert store.tier_keys() == ([a[0], b[3]], [])  # every unpinned block left before it
    assert store.stats().evictions_dram == 3
    store.check_integrity()
    store.unpin(lease)
    assert store.stats().pinned_blocks == 0
    c = fill(store, LAYOUT, make_chain(1, first_token=700), make_caches(LAYOUT, 1))
    assert store.tier_keys() == ([b[3], c[0]], [])


def test_leases_expire(tmp_path):
    now = [100.0]
    store = Store(make_config(tmp_path, LAYOUT, 1, 0, max_lease_s=5), clock=lambda: now[0])
    keys = fill(store, LAYOUT, make_chain(1), make_caches(LAYOUT, 1))
    assert store.pin_prefix(keys + [Key(keys[0].layout_key, 1)], ttl_s=60) is not None
    assert store.pin_prefix([Key(keys[0].layout_key, 1)], ttl_s=60) is None  # nothing held
    now[0] += 4.9  # the TTL is capped at max_lease_s=5
    other = fill(store, LAYOUT, make_chain(1, first_token=7), make_caches(LAYOUT, 1))
    assert store.tier_keys() == (keys, [])  # the pinned block stayed, the new one was dropped
    now[0] += 0.2
    fill(store, LAYOUT, make_chain(1, first_token=7), make_caches(LAYOUT, 1))
    assert store.tier_keys() == (other, [])
    assert store.stats().pinned_blocks == 0


def test_full_tiers_evict_instead_of_failing(tmp_path):
    store = _store(tmp_path, dram=0, ssd=2)
    k = fill(store, LAYOUT, make_chain(6), make_caches(LAYOUT, 6))  # asserts every put is True
    assert store.tier_keys() == ([], [k[4], k[5]])
    assert sorted(p.name for p in (tmp_path / k[0].layout_key).iterdir()) == sorted(
        SsdFiles(tmp_path).path(key).name for key in k[4:]
    )
    s = store.stats()
    assert (s.demotions, s.evictions_ssd, s.dram_bytes) == (6, 4, 0)


def test_inconsistent_puts_are_refused(tmp_path):
    store = _store(tmp_path, dram=4, ssd=4)
    chain = make_chain(2)
    good = chain.metas()[1]
    lk = layout_key(LAYOUT)
    payload = payload_of(*make_caches(LAYOUT, 1), 0)
    bad = [
        (BlockMeta(good.block_hash, None, good.token_ids), payload),  # wrong parent
        (BlockMeta(good.block_hash, good.parent, [1, 2, 3, 4]), payload),  # wrong tokens
        (BlockMeta(good.block_hash, good.parent, [2**40] * 4), payload),  # beyond int32
        (good, payload[:-1]),  # short payload
    ]
    assert [store.put(Key(lk, m.block_hash), LAYOUT, m, p) for m, p in bad] == [False] * 4
    assert store.stats().blocks_rejected == 4
    assert store.put(Key(lk, good.block_hash), LAYOUT, good, payload)
    assert not store.put(Key(lk, good.block_hash), LAYOUT, good, payload)
    assert store.stats().blocks_put_duplicate == 1


def test_restart_rebuilds_the_index_from_the_ssd_tier(tmp_path):
    caches = make_caches(LAYOUT, 5, seed=3)
    k = fill(_store(tmp_path, dram=0, ssd=8), LAYOUT, make_chain(5), caches)
    store = _store(tmp_path, dram=8, ssd=8)
    dram, ssd = store.tier_keys()
    assert (dram, sorted(ssd)) == ([], sorted(k))
    assert [_read(store, key) for key in k] == [payload_of(*caches, i) for i in range(5)]
    assert store.stats().hits_ssd == 5
    # a smaller SSD tier on restart keeps only what fits
    assert len(_store(tmp_path, dram=8, ssd=2).tier_keys()[1]) == 2


def _damage(tmp_path, k: list[Key]) -> None:
    files = SsdFiles(tmp_path)
    path = files.path(k[1])
    path.write_bytes(path.read_bytes()[:-10])  # torn: truncated
    path = files.path(k[2])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit in the payload
    path.write_bytes(bytes(data))
    (tmp_path / k[0].layout_key / "junk.kvb").write_bytes(b"PDKVBLK1 not a record")
    (tmp_path / k[0].layout_key / "0000000000000001.tmp").write_bytes(b"half a write")


def test_torn_and_corrupt_files_are_dropped_never_served(tmp_path):
    caches = make_caches(LAYOUT, 4, seed=4)
    k = fill(_store(tmp_path, dram=0, ssd=8), LAYOUT, make_chain(4), caches)
    _damage(tmp_path, k)
    store = _store(tmp_path, dram=8, ssd=8)
    assert store.stats().corrupt_dropped == 2  # the truncated file and the junk, at startup
    assert store.contains(k) == [True, False, True, True]
    assert _read(store, k[2]) is None  # the flipped bit fails the checksum on first read
    assert store.contains(k) == [True, False, False, True]
    assert store.stats().corrupt_dropped == 3
    assert sorted(os.listdir(tmp_path / k[0].layout_key)) == sorted(
        SsdFiles(tmp_path).path(key).name for key in (k[0], k[3])
    )
    assert _read(store, k[3]) == payload_of(*caches, 3)
    store.check_integrity()


def test_verify_on_start_checks_every_checksum(tmp_path):
    k = fill(_store(tmp_path, dram=0, ssd=8), LAYOUT, make_chain(4), make_caches(LAYOUT, 4))
    _damage(tmp_path, k)
    store = _store(tmp_path, dram=8, ssd=8, verify_on_start=True)
    assert store.stats().corrupt_dropped == 3
    assert store.contains(k) == [True, False, False, True]


def test_integrity_check_finds_a_leaked_pin_and_a_stray_file(tmp_path):
    store = _store(tmp_path, dram=0, ssd=4)
    k = fill(store, LAYOUT, make_chain(2), make_caches(LAYOUT, 2))
    entries = store.acquire(k[:1])  # a load that never releases
    store.check_integrity(idle=False)
    with pytest.raises(AssertionError, match="1 pins but 0 leases"):
        store.check_integrity()
    store.release(entries)
    store.check_integrity()
    (tmp_path / k[0].layout_key / "00000000000000aa.kvb").write_bytes(b"stray")
    with pytest.raises(AssertionError, match="SSD files != SSD index"):
        store.check_integrity()


def test_blocks_leaving_the_store_are_logged_for_readers(tmp_path):
    store = _store(tmp_path, dram=2, ssd=1)
    start = store.removal_cursor()
    k = fill(store, LAYOUT, make_chain(5), make_caches(LAYOUT, 5))
    # DRAM holds 2, SSD 1: blocks 0 and 1 left the store (demoted, then deleted for room)
    assert store.contains(k) == [False, False, True, True, True]
    assert store.removed_since(start, k[0].layout_key, 10) == ([k[0].block_hash, k[1].block_hash],
                                                               start + 2)  # fmt: skip
    assert store.removed_since(start, "other-layout", 10) == ([], start + 2)
    assert store.removed_since(start, k[0].layout_key, 1) == ([k[0].block_hash], start + 1)
    assert store.removed_since(start + 2, k[0].layout_key, 10) == ([], start + 2)
    assert store.removal_cursor() == start + 2  # a new reader hears of later removals only
    store.check_integrity()


def test_the_removal_log_is_bounded_and_a_slow_reader_skips_ahead():
    from pdserve.kv_store.removals import RemovalLog

    log = RemovalLog(capacity=3)
    for h in range(5):
        log.append(Key("a" if h != 3 else "b", h))
    assert log.read(0, "a", 10) == ([2, 4], 5)  # 0 and 1 fell off; 3 is another layout's
    assert log.read(4, "a", 10) == ([4], 5)
    assert log.read(5, "a", 10) == ([], 5)


def test_an_ssd_hit_two_loads_read_at_once_is_copied_into_dram_once(tmp_path):
    store = _store(tmp_path, dram=1, ssd=4)
    caches = make_caches(LAYOUT, 2, seed=4)
    k = fill(store, LAYOUT, make_chain(2), caches)
    assert store.tier_keys() == ([k[1]], [k[0]])
    slots: list[bytearray] = []  # what the DRAM tier took from `alloc` (registered memory)
    store.alloc = lambda n: slots.append(bytearray(n)) or slots[-1]
    first, second = store.acquire([k[0]]), store.acquire([k[0]])
    file_read, other = store._files.read, []

    def other_load_reads_meanwhile(key, nbytes):  # it promotes the block while we read
        store._files.read = file_read
        other.append(store.read(second[0]))
        return file_read(key, nbytes)

    store._files.read = other_load_reads_meanwhile
    data = store.read(first[0])
    store.release(first + second)
    assert len(slots) == 1 and data is slots[0] and other[0] is slots[0]  # no second copy
    assert bytes(data) == payload_of(*caches, 0)
    assert store.tier_keys() == ([k[0]], [k[0], k[1]]) and store.stats().hits_ssd == 2
    store.check_integrity()
