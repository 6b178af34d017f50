"""Per-phase tensor parallelism: a prefill worker of TP p pushes a prompt's KV into a decode
worker of TP d (each a real group of rank processes, gloo), over the real tcp and nixl
connectors, re-sharding the KV heads on the way. The decode worker then gives the greedy tokens
of one co-located engine of TP 1, each decode rank received exactly the bytes of its own heads,
and both sides free every block. The sides are driven in-process, as tests/serving/
test_worker_sides.py does (the test relays what the router would)."""

from __future__ import annotations

import importlib.util

import pytest
from factories import hand_off, make_engine, make_model_files, run_to_completion

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import KVLayout, make_receiver, make_sender
from pdserve.kv_transfer.group import ReceiverGroup
from pdserve.protocol import messages as m
from pdserve.serving.build import kv_layout

HAS_NIXL = any(importlib.util.find_spec(n) for n in ("nixl", "nixl_cu12", "nixl_cu13"))
PROMPT = list(range(3, 24))  # 21 tokens: 6 blocks of 4
PARAMS = m.Params(max_tokens=6, ignore_eos=True)
# 4 query heads and 2 KV heads: TP 1, 2 split them, TP 4 replicates each KV head on 2 ranks
MODEL = dict(num_heads=4, num_kv_heads=2, hidden_size=64, intermediate_size=128)
CASES = [(1, 2), (2, 1), (2, 2), (1, 4)]


@pytest.fixture(scope="module")
def files():
    return make_model_files(seed=5, **MODEL)


@pytest.fixture(scope="module")
def reference(files):
    engine = make_engine(files)
    return run_to_completion(engine, [PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0]


def layout_of(engine, tp: int) -> KVLayout:
    """What the worker's handshake sends (`serving/build.py`): per head, or an MLA latent."""
    assert engine.config.tensor_parallel_size == tp
    return kv_layout(engine)


def handoff(files, backend: str, p: int, d: int, ep: tuple[int, int] = (1, 1)):
    """Run PROMPT through a prefill group of p ranks and a decode group of d ranks (`ep`: their
    expert-parallel sizes); return (tokens, PrefillDone, bytes each decode rank received, the
    decode layout)."""
    d_engine = make_engine(files, role="decode", tensor_parallel_size=d, expert_parallel_size=ep[1])
    p_engine = make_engine(
        files, role="prefill", tensor_parallel_size=p, expert_parallel_size=ep[0]
    )
    d_layout, p_layout = layout_of(d_engine, d), layout_of(p_engine, p)
    ranks = d_engine.runner.rank_caches
    receiver = ReceiverGroup(
        [make_receiver(backend, d_layout.shard(r), k, v) for r, (k, v) in enumerate(ranks)]
    )
    receiver.start()
    sender = make_sender(backend, p_layout, *p_engine.runner.rank_caches[0],
                         ranks=p_engine.runner.rank_caches)  # fmt: skip
    try:
        tokens, done, placement = hand_off(p_engine, d_engine, sender, receiver, PROMPT, PARAMS)
        assert len(placement.kv_endpoints) == d  # one endpoint per decode rank
        received = [r.stats().bytes for r in receiver.receivers]
        for engine in (p_engine, d_engine):
            engine.check_integrity()
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return tokens, done, received, d_layout, len(placement.block_ids)
    finally:
        receiver.close()
        sender.close()
        d_engine.close()
        p_engine.close()


NO_NIXL = pytest.mark.skipif(not HAS_NIXL, reason="NIXL is not installed")


@pytest.mark.parametrize("backend", ["tcp", pytest.param("nixl", marks=NO_NIXL)])
@pytest.mark.parametrize("p, d", CASES)
def test_prefill_and_decode_of_different_tp_give_the_tokens_of_tp1(files, reference, backend, p, d):
    tokens, done, received, layout, blocks = handoff(files, backend, p, d)
    assert done.error is None and done.first_token == reference[0]
    assert tokens == reference
    # each decode rank received its heads of every block of every layer, K and V: no more
    share = [layout.num_layers * 2 * blocks * layout.shard(r).block_bytes for r in range(d)]
    assert received == share
    assert done.transfer_bytes == sum(share)


@pytest.mark.parametrize("whole", [False, True], ids=["layers", "whole"])
def test_a_chunked_prompts_blocks_are_pushed_as_each_chunk_completes_them(files, reference, whole):
    """Chunks of 6 tokens (blocks of 4: chunks end mid-block): each layer sends the blocks a
    chunk completed under the next chunks, the partial block once it is whole, the last
    block with the last chunk; every block of every layer exactly once. `--kv-push whole`
    sends each layer's blocks at once, after the prompt's last layer."""
    d_engine = make_engine(files, role="decode")
    p_engine = make_engine(files, role="prefill", chunk_size=6)
    d_layout, p_layout = layout_of(d_engine, 1), layout_of(p_engine, 1)
    receiver = make_receiver("tcp", d_layout, d_engine.runner.k_caches, d_engine.runner.v_caches)
    receiver.start()
    sender = make_sender("tcp", p_layout, p_engine.runner.k_caches, p_engine.runner.v_caches)
    layers = p_layout.num_layers
    calls = []
    send_layer = sender.send_layer
    sender.send_layer = lambda *a: calls.append(a[2:]) or send_layer(*a)  # layer, src, dst
    try:
        hand = (p_engine, d_engine, sender, receiver, PROMPT, PARAMS)
        tokens, done, placement = hand_off(*hand, whole=whole)
        assert done.error is None and tokens == reference
        blocks = placement.block_ids  # 21 tokens: 6 blocks, the last holding one token
        # chunks end at tokens 6, 12, 18, 21: blocks [0], [1, 2], [3], [4, 5]
        chunks = [blocks[:1], blocks[1:3], blocks[3:4], blocks[4:]]
        if whole:  # every layer at once, in order, after the last chunk's last layer
            assert [(n, list(dst)) for n, _, dst in calls] == [(n, blocks) for n in range(layers)]
        for layer in range(layers):
            sent = [list(dst) for n, _, dst in calls if n == layer]
            assert sent == ([blocks] if whole else chunks), sent
        assert receiver.stats().bytes == done.transfer_bytes
        assert done.transfer_bytes == layers * 2 * len(blocks) * p_layout.block_bytes
        for engine in (p_engine, d_engine):
            engine.check_integrity()
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        receiver.close()
        sender.close()
        d_engine.close()
        p_engine.close()
