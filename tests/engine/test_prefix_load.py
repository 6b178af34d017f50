"""A prefix whose KV arrives from outside (the KV store) while the step that computes the rest of
the prompt runs: the model waits for each layer before using it, a load that falls short voids
that step for its sequence (recomputed, same tokens), and no block is lost either way."""

from __future__ import annotations

import threading
import time

import pytest
from factories import make_engine, make_model_files, run_to_completion

from pdserve.engine.block_hash import block_hashes
from pdserve.engine.kv_connector import PrefixLoader
from pdserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
PROMPT = [7, 3, 99, 42, 5, 18, 77, 23, 64, 11, 90, 2, 31, 8, 55, 120, 9, 4, 66]  # 4 full blocks


@pytest.fixture(scope="module")
def files():
    return make_model_files(seed=3)


@pytest.fixture(scope="module")
def source(files):
    """An engine that computed PROMPT (its blocks stay cached) and the greedy reference."""
    eng = make_engine(files)
    out = run_to_completion(eng, [PROMPT], GREEDY)[0]
    ids = [eng.block_manager.hash_to_block[h] for h in block_hashes(PROMPT[:16], 4)]
    return eng, ids, out


class CopyLoad:
    """Copies the source engine's prefix blocks into the destination layer by layer on a
    thread, slowly, recording when the model asked for each layer. `good`: blocks that land
    intact; the rest get garbage (as a torn or failed load leaves them)."""

    def __init__(self, src, dst, src_ids, dst_ids, first_token, good, delay_s=0.02):
        self.first_token, self.num_tokens = first_token, len(dst_ids) * 4
        self.good = good
        self.layers_landed = 0
        self.waits: list[tuple[int, int]] = []  # (layer asked for, layers landed by then)
        self.cond = threading.Condition()
        self.thread = threading.Thread(
            target=self._copy, args=(src, dst, src_ids, dst_ids, delay_s), daemon=True
        )
        self.thread.start()

    def _copy(self, src, dst, src_ids, dst_ids, delay_s):
        for layer in range(len(dst.runner.k_caches)):
            time.sleep(delay_s)
            for s, d in ((src.runner.k_caches, dst.runner.k_caches),
                         (src.runner.v_caches, dst.runner.v_caches)):  # fmt: skip
                d[layer][dst_ids] = s[layer][src_ids]
                d[layer][dst_ids[self.good :]] = 1e4  # what did not land is garbage
            with self.cond:
                self.layers_landed = layer + 1
                self.cond.notify_all()

    def wait_layer(self, layer: int) -> None:
        with self.cond:
            self.waits.append((layer, self.layers_landed))
            self.cond.wait_for(lambda: self.layers_landed > layer)

    def finish(self) -> int:
        self.thread.join()
        return self.good * 4


class CopyLoader(PrefixLoader):
    """A connector that loads every new sequence's prefix from `source_engine` under the step."""

    def __init__(self, engine, source_engine, src_ids, good):
        self.engine, self.source_engine, self.src_ids, self.good = (
            engine,
            source_engine,
            src_ids,
            good,
        )
        self.loads = []

    def on_allocate(self, seq, under_step):
        assert under_step  # a scheduled admission: the load may run under the step
        n = len(self.src_ids)
        load = CopyLoad(self.source_engine, self.engine, self.src_ids, seq.block_table[:n], 0,
                        self.good)  # fmt: skip
        seq.prefix_load = load
        seq.num_cached_tokens = seq.num_computed_tokens = n * 4
        self.loads.append(load)


def attach_loader(engine, source_engine, src_ids, good):
    loader = CopyLoader(engine, source_engine, src_ids, good)
    engine.connect(loader)
    return loader.loads


def test_the_model_waits_for_each_layer_of_a_prefix_loading_under_the_step(files, source):
    src_engine, src_ids, reference = source
    engine = make_engine(files)
    loads = attach_loader(engine, src_engine, src_ids, good=4)
    assert run_to_completion(engine, [PROMPT], GREEDY)[0] == reference
    (load,) = loads
    assert [layer for layer, _ in load.waits] == [0, 1]  # each layer asked for, in order
    assert load.waits[0][1] == 0  # the step began before the prefix had landed: overlapped
    assert engine.block_manager.hits == 0  # nothing came from the local cache
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("good", [0, 2])
def test_a_load_that_falls_short_voids_the_step_and_recomputes_the_rest(files, source, good):
    src_engine, src_ids, reference = source
    engine = make_engine(files)
    attach_loader(engine, src_engine, src_ids, good=good)
    seq = engine.add_request(list(PROMPT), GREEDY)
    assert engine.step() == []  # void: no token sampled from garbage KV
    assert seq.prefix_load is None
    assert seq.num_computed_tokens == seq.num_cached_tokens == good * 4
    assert seq.block_hashes == []  # nothing published in the prefix cache yet
    while engine.has_work():
        engine.step()
    assert seq.output_token_ids == reference  # blocks past `good` were computed over
    bm = engine.block_manager
    assert seq.block_hashes == [] and len(bm.hash_to_block) == 5  # 4 prompt + 1 output block
    engine.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


def test_a_load_is_settled_even_when_the_step_fails(files, source):
    """The step raises (the worker then fails its requests): the load has ended before the
    engine returns, so no thread is left writing into blocks that are about to be freed."""
    src_engine, src_ids, _ = source
    engine = make_engine(files)
    loads = attach_loader(engine, src_engine, src_ids, good=4)

    def broken(*args, **kwargs):
        raise RuntimeError("model failure")

    engine.runner.run = broken
    seq = engine.add_request(list(PROMPT), GREEDY)
    with pytest.raises(RuntimeError):
        engine.step()
    assert not loads[0].thread.is_alive() and seq.prefix_load is None
    engine.abort(seq.request_id)
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
