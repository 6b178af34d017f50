"""BlockManager: exact block ids, prefix hits, LRU eviction order, integrity."""

import pytest
from factories import make_sequence

from pdserve.engine.block_hash import block_hashes, hash_block
from pdserve.engine.block_manager import BlockManager


def test_allocate_gives_lowest_free_blocks_in_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_sequence(range(1, 10))  # 9 tokens -> 3 blocks
    assert bm.allocate(seq)
    assert seq.block_table == [0, 1, 2]
    assert seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 5
    bm.check_integrity([seq])


def test_prefix_hit_reuses_computed_blocks_and_never_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_sequence(range(1, 10), "a")
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.register_computed(a)  # blocks 0 and 1 are full -> cached
    assert a.block_hashes == block_hashes(list(range(1, 10)), 4)
    b = make_sequence([*range(1, 9), 42, 43], "b")  # same first 8 tokens
    assert bm.allocate(b)
    assert b.block_table[:2] == [0, 1] and b.num_cached_tokens == 8
    assert bm.blocks[0].ref_count == 2
    c = make_sequence(range(1, 9), "c")  # exactly two cached blocks: last one recomputed
    assert bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == 0 and c.block_table[1] != 1
    bm.check_integrity([a, b, c])


def test_freed_cached_blocks_are_evicted_lru_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_sequence([1, 2, 3, 4, 5], "a")  # 3 blocks: 0,1,2
    bm.allocate(a)
    a.num_computed_tokens = 5
    bm.register_computed(a)
    bm.free(a)
    assert list(bm.free_queue) == [3, 2, 1, 0]  # tail first, shared prefix last
    b = make_sequence([9, 9, 9], "b")  # needs 2 blocks: takes 3 then 2 (uncached, partial)
    bm.allocate(b)
    assert b.block_table == [3, 2]
    c = make_sequence([1, 2, 3, 4, 7], "c")  # prefix [1,2],[3,4] still cached in 0 and 1
    assert bm.allocate(c) is False  # needs 1 new block + 2 hits; only the 2 hit blocks are free
    bm.free(b)
    assert bm.allocate(c)
    assert c.block_table[:2] == [0, 1] and c.num_cached_tokens == 4
    bm.check_integrity([c])


def test_eviction_removes_hash_and_emits_events():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = make_sequence([1, 2, 3], "a")
    bm.allocate(a)
    a.num_computed_tokens = 3
    bm.register_computed(a)
    bm.free(a)
    h = hash_block(None, (1, 2))
    assert bm.drain_events() == [("stored", h)]
    b = make_sequence([5, 6, 7], "b")
    bm.allocate(b)  # takes both blocks: evicts the cached one
    assert h not in bm.hash_to_block
    assert bm.drain_events() == [("removed", h)]
    bm.check_integrity([b])


def test_hash_hit_is_confirmed_by_token_ids():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_sequence([1, 2, 3], "a")
    bm.allocate(a)
    a.num_computed_tokens = 3
    bm.register_computed(a)
    bm.blocks[a.block_table[0]].token_ids = (9, 9)  # simulate a colliding hash
    b = make_sequence([1, 2, 3], "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_integrity_detects_a_leak():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_sequence([1, 2, 3], "a")
    bm.allocate(a)
    with pytest.raises(AssertionError, match="ref 1, tables 0"):
        bm.check_integrity([])  # nobody holds a's blocks: leaked


def test_hashes_agree_across_processes():
    import subprocess
    import sys

    code = (
        "from pdserve.engine.block_hash import block_hashes; "
        "print(block_hashes(list(range(40)), 16))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(block_hashes(list(range(40)), 16))


def test_blocks_set_aside_leave_the_table_and_stay_out_of_the_free_queue_until_given_back():
    bm = BlockManager(num_blocks=6, block_size=2)
    seq = make_sequence(range(1, 10))  # 9 tokens -> blocks 0..4
    assert bm.allocate(seq) and seq.block_table == [0, 1, 2, 3, 4]
    assert bm.set_aside(seq, 1, {1, 2}) == [2, 1]  # a late load may still write 1 and 2
    assert seq.block_table == [0] and list(bm.free_queue) == [5, 4, 3]
    bm.check_integrity([seq])
    assert not bm.append_slots(seq, 9)  # 4 more: only 3 are free, 1 and 2 are held
    assert bm.append_slots(seq, 8) and seq.block_table == [0, 5, 4, 3]
    bm.give_back([2, 1])
    assert list(bm.free_queue) == [2, 1]
    bm.check_integrity([seq])
    bm.free(seq)
    bm.check_integrity([])
    assert bm.num_free_blocks == 6
