"""The KV store link of a pipeline-parallel engine (2 stages, real processes over gloo, a layer
each), wired as `serving/build.py` wires it (`store_link`). Stage 0 holds every layer's
cache, the later stage's in shared memory, so the link offloads a prompt's blocks with every
stage's layers and loads a prefix back into every stage's layers: the pipeline's blocks loaded
into a one-process engine are byte for byte the pipeline's, the one-process engine's loaded
into the pipeline are byte for byte its own, and both give the greedy tokens of an engine
without a store; the blocks a pipeline of a prefill worker evicts reach the store with every
stage's layers too. A load waits until the later stages have run every step sent to them
(`PPGroup.drain`): a chunk that samples nothing is not waited for, and the later stages may
still be writing into blocks stage 0 has freed."""

from __future__ import annotations

import pytest
import torch
from factories import make_engine, run_to_completion

from pdserve.engine.block_hash import block_hashes
from pdserve.kv_store.client import StoreClient
from pdserve.kv_transfer.memory import layout_of
from pdserve.serving.build import store_link

from .test_store_link import BLOCKS, GREEDY, KV_GB, generate, settle

PIPELINE = dict(pipeline_parallel_size=2)  # the suite's tiny model (`files`): a layer a stage
A = list(range(3, 40))  # 37 tokens: 9 full blocks of 4 before the last token's
B = list(range(50, 87))
LONG = list(range(100, 150))  # 50 tokens: 7 chunks of 8


@pytest.fixture(scope="module")
def reference(files):
    engine = make_engine(files)
    try:
        return {tuple(p): run_to_completion(engine, [p], GREEDY)[0] for p in (A, B, LONG)}
    finally:
        engine.close()


@pytest.fixture
def linked(files, serve):
    """linked(link_role, **engine_kw) -> (co-located engine in chunks of 8, its StoreLink as
    a worker of `link_role` has it), every one on the same store; closed after the test."""
    made, served = [], []

    def factory(link_role="both", **engine_kw):
        engine = make_engine(files, chunk_size=8, **engine_kw)
        layout = layout_of(engine.fingerprint, engine.runner.k_caches)
        if not served:
            served.append(serve(layout))
        client = StoreClient(served[0].server.endpoint, layout, engine.runner.k_caches,
                             engine.runner.v_caches)  # fmt: skip
        link = store_link(client, engine, link_role)
        engine.connect(link)
        made.append((engine, link))
        return engine, link

    yield factory
    for engine, link in made:
        link.close()
        engine.close()


def blocks(engine, hashes: list[int]) -> list[torch.Tensor]:
    """The blocks of `hashes` in every layer, K then V, as `engine` caches them (a pipeline's
    later layers read through stage 0's mapping of the stage's memory)."""
    ids = [engine.block_manager.hash_to_block[h] for h in hashes]
    return [t[ids].clone() for t in (*engine.runner.k_caches, *engine.runner.v_caches)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_pipelines_blocks_go_to_the_store_and_back_with_every_stages_layers(linked, reference):
    pipeline, p_link = linked(**PIPELINE)
    single, s_link = linked()
    prefix = block_hashes(A, 4)[:9]  # what a load may bring: not the last token's block

    assert generate(pipeline, p_link, A) == reference[tuple(A)]
    settle(p_link)  # offloaded as it finished, every layer's K and V
    assert generate(single, s_link, A) == reference[tuple(A)]
    assert s_link.hit_tokens == 36 and same(blocks(single, prefix), blocks(pipeline, prefix))

    prefix = block_hashes(B, 4)[:9]
    assert generate(single, s_link, B) == reference[tuple(B)]
    settle(s_link)
    assert generate(pipeline, p_link, B) == reference[tuple(B)]  # stage 1 attends the load
    assert p_link.hit_tokens == 36 and same(blocks(pipeline, prefix), blocks(single, prefix))
    for engine in (pipeline, single):
        engine.check_integrity()


def test_blocks_a_pipeline_evicts_reach_the_store_with_every_stages_layers(linked, reference):
    # a prefill worker's link: blocks reach the store as its prefix cache evicts them
    pipeline, p_link = linked("prefill", kv_cache_gb=KV_GB, **PIPELINE)
    single, s_link = linked()
    assert pipeline.block_manager.num_blocks == BLOCKS
    prefix = block_hashes(A, 4)[:9]
    assert generate(pipeline, p_link, A) == reference[tuple(A)]
    computed = blocks(pipeline, prefix)
    assert generate(pipeline, p_link, B) == reference[tuple(B)]  # every block: evicts A's
    settle(p_link)
    assert p_link.evicted_offloads >= len(prefix)
    assert generate(single, s_link, A) == reference[tuple(A)]
    assert s_link.hit_tokens == 36
    assert same(computed, blocks(single, prefix))


def test_a_load_waits_until_the_later_stages_have_run_every_step_sent(linked, reference):
    single, s_link = linked()
    assert generate(single, s_link, A) == reference[tuple(A)]
    settle(s_link)
    pipeline, link = linked(**PIPELINE)
    pp, drain = pipeline.runner.pp, link.settle
    unsettled, loading = [], []  # steps not waited for: when a load is due / when it starts

    def spy_drain():
        unsettled.append(pp.unsettled)
        drain()

    def spy_load(*args, real=link.client.start_load):
        loading.append(pp.unsettled)
        return real(*args)

    link.settle, link.client.start_load = spy_drain, spy_load
    long = pipeline.add_request(LONG, GREEDY)
    pipeline.step()  # LONG's first chunk goes down the pipeline, not waited for
    a = pipeline.add_request(A, GREEDY)  # scheduled beside LONG's later chunks
    while pipeline.has_work():
        pipeline.step()
        for rid in link.poll():
            pipeline.release(rid)
    assert unsettled and unsettled[0] > 0  # LONG's chunks were still on their way
    assert loading == [0] and link.hit_tokens == 36
    assert long.output_token_ids == reference[tuple(LONG)]
    assert a.output_token_ids == reference[tuple(A)]
    pipeline.check_integrity()
