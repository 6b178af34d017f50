"""A worker's StoreLink on a tiny engine: blocks evicted from the engine's prefix cache go to the
store and come back, the router's index follows the store's evictions, a dead store only means
computing."""

from __future__ import annotations

import pytest
from factories import make_engine, make_model_files, make_sequence, run_to_completion

from pdserve.engine.block_hash import block_hashes
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_store.client import StoreClient
from pdserve.kv_store.config import payload_bytes
from pdserve.kv_transfer.memory import layout_of
from pdserve.protocol import messages as m
from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore
from pdserve.router.placement import cached_blocks
from pdserve.router.state import WorkerInfo
from pdserve.serving.store_link import StoreLink, split_index_events

from .helpers import both_transports, make_config

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
A = [5, 17, 33, 2, 9, 71, 8, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]  # 6 blocks
B = list(range(100, 137))  # 37 tokens + 3 computed outputs: all 10 blocks
C = list(range(200, 237))
BLOCKS = 10
KV_GB = BLOCKS * 4 * 2 * 2 * 2 * 16 * 4 / (1 << 30)  # blocks of 4 tokens, 2 layers, 2x16 K/V


@pytest.fixture(scope="module")
def files():
    return make_model_files(seed=1)


@pytest.fixture(scope="module")
def reference(files):
    eng = make_engine(files, enable_prefix_caching=False)
    return {tuple(p): run_to_completion(eng, [p], GREEDY)[0] for p in (A, B, C)}


@pytest.fixture
def linked(files, serve, tmp_path):
    """linked(**store_kw) -> (engine with a 10-block cache, its StoreLink, the Served store).
    The link offloads evicted blocks only, unless given offload_finished=True."""
    made = []

    def factory(dram_blocks=64, ssd_blocks=0, endpoint=None, **link_kw):
        engine = make_engine(files, kv_cache_gb=KV_GB)
        assert engine.block_manager.num_blocks == BLOCKS
        layout = layout_of(engine.fingerprint, engine.runner.k_caches)
        served = None
        if endpoint is None:
            config = make_config(tmp_path / "ssd", layout, dram_blocks, ssd_blocks)
            served = serve(layout, config=config)
            endpoint = served.server.endpoint
        client = StoreClient(endpoint, layout, engine.runner.k_caches, engine.runner.v_caches)
        link = StoreLink(client, engine.block_manager, **{"offload_finished": False, **link_kw})
        engine.connect(link)
        made.append(link)
        return engine, link, served

    yield factory
    for link in made:
        link.close()


def test_the_eviction_hook_sees_each_cached_block_intact_before_reuse():
    bm = BlockManager(num_blocks=4, block_size=2)
    seen = []
    bm.connector.on_evict = lambda b: seen.append((b.block_id, b.hash, b.parent, b.token_ids))
    a = make_sequence([1, 2, 3, 4, 5], "a")  # blocks 0, 1, 2; blocks 0 and 1 full
    bm.allocate(a)
    a.num_computed_tokens = 5
    bm.register_computed(a)
    bm.free(a)  # free queue: 3, 2, 1, 0 (tail first)
    assert bm.allocate(make_sequence([9] * 7, "b"))  # 4 blocks: popped 3, 2, 1, 0
    h0, h1 = block_hashes([1, 2, 3, 4], 2)
    assert seen == [(1, h1, h0, (3, 4)), (0, h0, None, (1, 2))]  # 3 and 2 were not cached
    assert bm.hash_to_block == {}


def generate(engine, link: StoreLink, prompt: list[int]) -> list[int]:
    """One request to completion, polling the link between steps as the worker loop does."""
    seq = engine.add_request(list(prompt), GREEDY)
    while engine.has_work():
        engine.step()
        for rid in link.poll():
            engine.release(rid)
    return seq.output_token_ids


def settle(link: StoreLink) -> None:
    link.poll()  # queue evicted copies
    assert link.client.flush(10)
    link.poll()  # collect the tickets


@both_transports
def test_blocks_evicted_from_the_prefix_cache_are_loaded_back_from_the_store(linked, reference):
    engine, link, served = linked()
    bm = engine.block_manager
    assert generate(engine, link, A) == reference[tuple(A)]
    a_hashes = block_hashes(A, 4)  # 5 full prompt blocks, cached locally now
    assert all(h in bm.hash_to_block for h in a_hashes)
    assert generate(engine, link, B) == reference[tuple(B)]  # needs all 10 blocks: evicts A's
    settle(link)
    assert not any(h in bm.hash_to_block for h in a_hashes)
    assert link.evicted_offloads >= len(a_hashes)
    assert link.client.lookup(a_hashes) == len(a_hashes)
    assert generate(engine, link, A) == reference[tuple(A)]  # identical greedy output
    assert link.hit_tokens == 20  # blocks 0-4 loaded; the block of the last token computed
    held, removed = split_index_events(link.take_index_events())
    assert set(a_hashes) <= set(held) and removed == []
    engine.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


@both_transports
def test_blocks_the_store_holds_are_not_copied_again(linked, reference):
    engine, link, _ = linked()
    copied = []
    real_on_evict = link.on_evict

    def spy(block):
        n = len(link.copies)
        real_on_evict(block)
        if len(link.copies) > n:
            copied.append(block.hash)

    link.on_evict = spy  # the engine's connector is the link
    a_hashes = block_hashes(A + reference[tuple(A)][:3], 4)  # 6 full blocks were computed
    for p in (A, B):
        assert generate(engine, link, p) == reference[tuple(p)]
    settle(link)
    assert set(a_hashes) <= set(copied)
    copied.clear()
    for p in (A, B):  # A is loaded from the store; B evicts its blocks again
        assert generate(engine, link, p) == reference[tuple(p)]
    settle(link)
    assert copied and not set(a_hashes) & set(copied)  # B's tail was new; A's were known
    assert link.copy_bytes == 0 and not link.evicting


class NoSocket:
    """A router channel that sends nowhere: this test reads the router's index, not its
    messages (and needs no event loop for a socket)."""

    endpoint = "tcp://127.0.0.1:1"

    def send(self, worker_id: str, msg) -> bool:
        return True

    def close(self) -> None:
        pass


@both_transports
def test_the_routers_index_drops_what_the_store_evicts(linked, reference):
    engine, link, served = linked(dram_blocks=5)  # the store holds only 5 blocks
    assert generate(engine, link, A) == reference[tuple(A)]
    assert generate(engine, link, B) == reference[tuple(B)]  # A's 6 blocks evicted: 5 fit
    settle(link)
    # C evicts B's blocks into the store, which evicts A's (and some of B's) to make room
    assert generate(engine, link, C) == reference[tuple(C)]
    settle(link)
    router = RouterCore(RouterConfig(block_size=4), channel=NoSocket())
    try:
        worker = WorkerInfo("d0", "decode", link.client.layout, None, BLOCKS, 512, 0)
        worker.has_store = True
        router.workers["d0"] = worker
        held, removed = split_index_events(link.take_index_events())
        router.on_heartbeat("d0#hb", m.Heartbeat("d0", None, offloaded=held,
                                                  store_removed=removed))  # fmt: skip
        assert removed  # the store reported its evictions
        a_hashes = block_hashes(A, 4)
        assert not set(a_hashes) & router.store_index  # all of A's blocks were evicted
        assert cached_blocks(router.view(), worker, a_hashes) == 0
        stored = {k.block_hash for tier in served.store.tier_keys() for k in tier}
        assert router.store_index == stored  # exactly what the store holds
    finally:
        router.channel.close()


@both_transports
def test_a_dead_store_only_means_computing(linked, reference, serve):
    engine, link, served = linked()
    assert generate(engine, link, A) == reference[tuple(A)]
    served.server.close()  # killed mid-run
    assert generate(engine, link, B) == reference[tuple(B)]  # evictions: copies fail, not the step
    settle(link)
    assert generate(engine, link, A) == reference[tuple(A)]
    assert link.hit_tokens == 0 and link.copy_bytes == 0
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == BLOCKS


@both_transports
def test_no_store_at_all_and_a_full_copy_budget_cost_nothing(linked, reference, transport):
    engine, link, _ = linked(endpoint=f"{transport}://127.0.0.1:9")  # nothing listens there
    for p in (A, B, A):
        assert generate(engine, link, p) == reference[tuple(p)]
    settle(link)
    assert link.hit_tokens == 0
    engine, link, served = linked(max_copy_bytes=0)
    for p in (A, B, A):
        assert generate(engine, link, p) == reference[tuple(p)]
    settle(link)
    assert served.store.stats().blocks_put == 0 and link.hit_tokens == 0


@pytest.mark.parametrize("role", ["both", "decode", "prefill"])
def test_only_a_prefill_worker_loads_before_its_step_and_keeps_finished_blocks_off_the_store(
    files, role
):
    """A prefill worker streams each layer on as soon as it is computed, so a prefix loading
    under its step could be sent before it is known good: it loads before the step instead."""
    engine = make_engine(files, kv_cache_gb=KV_GB, role=role)
    layout = layout_of(engine.fingerprint, engine.runner.k_caches)
    client = StoreClient("tcp://127.0.0.1:9", layout, engine.runner.k_caches,
                         engine.runner.v_caches)  # fmt: skip
    link = StoreLink.for_role(client, engine.block_manager, role)
    calls = []
    link.load_prefix = lambda seq, overlap=False: calls.append(overlap)
    try:
        engine.connect(link)
        engine.scheduler.connector.on_allocate(make_sequence(A), True)  # a scheduled admission
        engine.scheduler.connector.on_allocate(make_sequence(A), False)  # for a KV transfer
        assert calls == [role != "prefill", False]
        assert link.offload_finished == (role != "prefill")
    finally:
        link.close()


@both_transports
def test_a_finished_requests_blocks_are_held_until_the_store_has_read_them(linked, reference):
    engine, link, served = linked(offload_finished=True)
    bm = engine.block_manager
    seq = engine.add_request(list(A), GREEDY)
    while engine.has_work():
        engine.step()
    assert seq.output_token_ids == reference[tuple(A)]
    assert seq.request_id in engine.scheduler.held  # the store has not read them yet
    assert bm.num_free_blocks < bm.num_blocks
    assert link.client.flush(10)
    assert link.poll() == [seq.request_id]
    engine.release(seq.request_id)
    assert bm.num_free_blocks == bm.num_blocks
    computed = (A + reference[tuple(A)])[:24]  # 25 tokens; the last sampled one is not computed
    assert link.client.lookup(block_hashes(computed, 4)) == 6  # all six full blocks
    engine.check_integrity()


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from family_models import build

    from pdserve.model.loader import load_model_files

    folder = tmp_path_factory.mktemp("deepseek_v3")
    build("deepseek_v3", folder)
    return load_model_files(str(folder))


@both_transports
def test_an_mla_latent_cache_goes_to_the_store_and_comes_back(deepseek, serve, tmp_path):
    """DeepSeek-V3's latent blocks (one tensor per layer, no V; the store's payload is the
    latent of every layer): evicted, stored, loaded back, with the tokens of a cold run."""
    cold = make_engine(deepseek, enable_prefix_caching=False)
    want = {tuple(p): run_to_completion(cold, [p], GREEDY)[0] for p in (A, B)}
    engine = make_engine(deepseek, kv_cache_gb=BLOCKS * 4 * 2 * (32 + 8) * 4 / (1 << 30))
    assert engine.block_manager.num_blocks == BLOCKS and engine.runner.v_caches == []
    layout = layout_of(engine.fingerprint, engine.runner.k_caches, latent=True)
    assert payload_bytes(layout) == 2 * 4 * 40 * 4  # layers x block tokens x latent x fp32
    _evicted_stored_and_loaded_back(engine, layout, serve, tmp_path, want)


@both_transports
def test_an_int8_cache_goes_to_the_store_and_comes_back(files, serve, tmp_path):
    """`--kv-cache-dtype int8` blocks (each row's int8 values and float32 scale, moved as
    bytes): evicted, stored, loaded back, with the tokens of a cold run on that cache."""
    cold = make_engine(files, enable_prefix_caching=False, kv_cache_dtype="int8")
    want = {tuple(p): run_to_completion(cold, [p], GREEDY)[0] for p in (A, B)}
    block = 4 * 2 * 2 * 2 * (16 + 4)  # tokens x K/V x layers x kv heads x (int8 row + scale)
    engine = make_engine(files, kv_cache_gb=BLOCKS * block / (1 << 30), kv_cache_dtype="int8")
    assert engine.block_manager.num_blocks == BLOCKS
    layout = layout_of(engine.fingerprint, engine.runner.k_caches)
    assert payload_bytes(layout) == block
    _evicted_stored_and_loaded_back(engine, layout, serve, tmp_path, want)


def _evicted_stored_and_loaded_back(engine, layout, serve, tmp_path, want):
    """A's blocks evicted by B's into a store of `layout`, then loaded back for A: the tokens of
    `want` (a cold run) each time, A's 5 full blocks from the store."""
    served = serve(layout, config=make_config(tmp_path / "ssd", layout, 64, 0))
    client = StoreClient(served.server.endpoint, layout, engine.runner.k_caches,
                         engine.runner.v_caches)  # fmt: skip
    link = StoreLink(client, engine.block_manager, offload_finished=False)
    engine.connect(link)
    try:
        assert generate(engine, link, A) == want[tuple(A)]
        assert generate(engine, link, B) == want[tuple(B)]  # evicts A's blocks to the store
        settle(link)
        assert link.client.lookup(block_hashes(A, 4)) == 5
        assert generate(engine, link, A) == want[tuple(A)]
        assert link.hit_tokens == 20  # A's 5 full blocks loaded back
    finally:
        link.close()
    engine.check_integrity()
