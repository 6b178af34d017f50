"""Per-phase pipeline parallelism: a prefill worker of 2 stages (real processes, gloo; each
stage one process or a tensor-parallel group of 2) pushes a prompt's KV into a decode worker of
TP 1 or TP 2 over the real tcp and nixl connectors, each stage from its own process, over its
own connections (`kv_transfer/stage_link.py`, as `serving/build.py` wires it). The decode
worker then gives the greedy tokens of one co-located engine, each stage sent exactly its
layers' share of the bytes, and both sides free every block. The sides are driven in-process,
as tests/serving/test_tp_disaggregated.py does (the test relays what the router would); the
prompt is chunked, so its earlier chunks go down the pipeline without waiting."""

from __future__ import annotations

import pytest
from factories import hand_off, make_engine, make_model_files, run_to_completion

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import make_receiver
from pdserve.kv_transfer.group import ReceiverGroup
from pdserve.kv_transfer.stage_senders import StageSenders
from pdserve.protocol import messages as m
from pdserve.serving.build import kv_layout, prefill_sender
from pdserve.serving.worker_config import WorkerConfig
from serving.test_tp_disaggregated import NO_NIXL

PROMPT = list(range(3, 40))  # 37 tokens: 10 blocks of 4, 5 chunks of 8
PARAMS = m.Params(max_tokens=6, ignore_eos=True)
MODEL = dict(num_layers=4, num_heads=4, num_kv_heads=2, hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="module")
def files():
    return make_model_files(seed=7, **MODEL)


@pytest.fixture(scope="module")
def reference(files):
    engine = make_engine(files)
    return run_to_completion(engine, [PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0]


def handoff(files, backend: str, partition: str | None, d: int, p: int = 1):
    """PROMPT through a prefill worker of 2 stages of p ranks each into a decode worker of d
    ranks; returns (tokens, PrefillDone, each stage's sender stats, the decode layout, blocks
    pushed)."""
    d_engine = make_engine(files, role="decode", tensor_parallel_size=d)
    p_engine = make_engine(files, role="prefill", chunk_size=8, pipeline_parallel_size=2,
                           pp_layer_partition=partition, tensor_parallel_size=p)  # fmt: skip
    d_layout, p_layout = kv_layout(d_engine), kv_layout(p_engine)
    receiver = ReceiverGroup([make_receiver(backend, d_layout.shard(r), k, v)
                              for r, (k, v) in enumerate(d_engine.runner.rank_caches)])  # fmt: skip
    receiver.start()
    config = WorkerConfig(p_engine.config, ("tcp://127.0.0.1:1",), "p0", kv_transport=backend)
    sender = prefill_sender(config, p_engine, p_layout, p_engine.runner.rank_caches)
    assert isinstance(sender, StageSenders) and len(sender.senders) == 2
    try:
        tokens, done, placement = hand_off(p_engine, d_engine, sender, receiver, PROMPT, PARAMS)
        for engine in (p_engine, d_engine):
            engine.check_integrity()
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return tokens, done, sender.stage_stats(), d_layout, len(placement.block_ids)
    finally:
        receiver.close()
        sender.close()
        d_engine.close()
        p_engine.close()


@pytest.mark.parametrize("backend", ["tcp", pytest.param("nixl", marks=NO_NIXL)])
@pytest.mark.parametrize(("partition", "p", "d", "stage_layers"),
                         [(None, 1, 1, [2, 2]), ("1,3", 1, 2, [1, 3]), ("1,3", 2, 1, [1, 3]),
                          (None, 2, 2, [2, 2])])  # fmt: skip
def test_each_stage_pushes_its_layers_and_decode_gives_the_tokens_of_one_worker(
    files, reference, backend, partition, p, d, stage_layers
):
    """p 2: each stage a tensor-parallel group whose sender gathers its ranks' heads for
    each decode rank (re-sharded to decode TP 1, or rank to rank at decode TP 2)."""
    tokens, done, stages, layout, blocks = handoff(files, backend, partition, d, p)
    assert done.error is None and done.first_token == reference[0]
    assert tokens == reference
    # K and V of every block of each stage's layers, each decode rank its heads: no more
    whole = layout.split(1)  # the model's every KV head
    share = [n * 2 * blocks * whole.block_bytes for n in stage_layers]
    assert [s.bytes for s in stages] == share
    # every stage pushes each layer as each chunk completes blocks (in its own process, as it
    # computes the chunk), not once the prompt is done: as many messages per layer on each
    assert stages[0].layers > stage_layers[0] * d
    assert stages[0].layers * stage_layers[-1] == stages[-1].layers * stage_layers[0]
    assert done.transfer_bytes == sum(share)
