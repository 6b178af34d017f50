"""Disaggregated serving of other families: a prefill worker pushes the prompt's KV over tcp and
nixl into a decode worker (the sides driven in-process, as
tests/serving/test_tp_disaggregated.py does), which then gives a co-located engine's greedy
tokens; for Mistral the prompt runs past its sliding window; Qwen2 (q/k/v biases split by
head) goes from TP 2 into TP 1, Qwen3 (per-head q/k norms) from TP 1 into TP 2; Qwen3-MoE goes
from a prefill worker of TP 1 / EP 1 into a decode worker of TP 2 / EP 2 (2 ranks, each holding
half of the heads and 2 of the 4 experts whole); DeepSeek-V2 and V3 (an MLA latent cache)
push the latent alone, exactly layers x tokens x (kv_lora_rank + qk_rope_head_dim) x 4 bytes to
every decode rank (V3 into TP 2: replicated, not split by heads), and a latent cache meeting a
per-head one is refused by name."""

from __future__ import annotations

import pytest
from factories import make_engine, run_to_completion
from family_models import WINDOW, build, one_thread

from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.loader import load_model_files
from serving.test_tp_disaggregated import NO_NIXL, PROMPT, handoff

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


@pytest.mark.parametrize("backend", ["tcp", pytest.param("nixl", marks=NO_NIXL)])
@pytest.mark.parametrize(
    ("family", "p", "d", "ep"),
    [("mistral", 1, 1, (1, 1)), ("qwen2", 2, 1, (1, 1)), ("qwen3", 1, 2, (1, 1)),
     ("qwen3_moe", 1, 2, (1, 2)), ("deepseek_v2", 1, 1, (1, 1)), ("deepseek_v3", 1, 2, (1, 1))],
)  # fmt: skip
def test_kv_pushed_gives_the_colocated_tokens(tmp_path, family, p, d, ep, backend):
    build(family, tmp_path)
    files = load_model_files(str(tmp_path))
    assert len(PROMPT) > WINDOW
    engine = make_engine(files)
    [reference] = run_to_completion(engine, [PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))
    tokens, done, received, layout, blocks = handoff(files, backend, p, d, ep)
    assert done.error is None and done.first_token == reference[0]
    assert tokens == reference
    if family.startswith("deepseek"):  # the latent, whole, to every decode rank; nothing else
        mc = files.config
        assert layout.cache == "latent" and layout.tensors == 1
        tokens_pushed = blocks * layout.block_size  # whole blocks: 6 of 4 for 21 tokens
        latent = mc.kv_lora_rank + mc.head_dim  # 32 + 8 (qk_rope_head_dim)
        assert received == [mc.num_layers * tokens_pushed * latent * 4] * d  # float32


def test_a_latent_cache_is_refused_by_a_per_head_one_by_name():
    """A DeepSeek prefill worker meeting a decode worker of per-head K/V (same sizes
    otherwise): the handshake fails naming the cache kind, and nothing lands."""
    import torch

    from pdserve.kv_transfer import make_receiver, make_sender
    from pdserve.kv_transfer.layout import KVLayout

    heads = KVLayout("m", "float32", 2, 4, 1, 40)
    latent = KVLayout("m", "float32", 2, 4, 1, 40, cache="latent")
    zeros = [torch.zeros(4, 4, 1, 40) for _ in range(2)]
    receiver = make_receiver("tcp", heads, zeros, [torch.zeros(4, 4, 1, 40) for _ in range(2)])
    receiver.start()
    sender = make_sender("tcp", latent, [torch.ones(4, 4, 1, 40) for _ in range(2)], [])
    try:
        receiver.expect("m", [0])
        sender.send_layer(receiver.endpoint, "m", 0, [0], [0])
        result = sender.wait("m", timeout_s=10)
    finally:
        sender.close()
        receiver.close()
    assert not result.ok
    assert "cache: decode worker has 'heads', prefill worker has 'latent'" in result.error
    assert all((t == 0).all() for t in zeros)


def test_expert_parallel_ranks_hold_whole_experts_and_give_the_tokens_of_one(tmp_path):
    build("mixtral", tmp_path)
    files = load_model_files(str(tmp_path))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    reference = run_to_completion(make_engine(files), [PROMPT, PROMPT[:9]], params)
    engine = make_engine(files, tensor_parallel_size=2, expert_parallel_size=2)
    try:
        moe = engine.runner.model.layers[0].mlp
        assert [e is not None for e in moe.experts] == [True, True, False, False]  # rank 0's
        assert moe.experts[0].down.weight.shape == (64, 96)  # whole: not split by width
        assert (
            engine.runner.decode_path == "eager (tensor parallel, 2 ranks, experts over 2 groups)"
        )
        assert run_to_completion(engine, [PROMPT, PROMPT[:9]], params) == reference
    finally:
        engine.close()
