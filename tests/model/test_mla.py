"""Multi-head latent attention (`model/mla.py`) on tiny DeepSeek-V2/V3 checkpoints
(`family_models.py`; their greedy tokens, logits, prefix hits and chunked prefill against
transformers are in `test_families.py`): the cache holds one latent of kv_lora_rank +
qk_rope_head_dim values per token and layer and no V; the absorbed decode gives the
up-projected form's logits and tokens; the softmax scale is transformers' (YaRN's mscale)."""

from __future__ import annotations

import pytest
import torch
from factories import make_engine, run_to_completion
from family_models import build_each, one_thread

from model.test_families import last_logits
from model.test_fused_decode import PROMPTS as CONTEXTS
from model.test_fused_decode import decode_batch
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.kv_shape import KVShape
from pdserve.model.mla import softmax_scale

FAMILIES = ("deepseek_v2", "deepseek_v3")
pytestmark = pytest.mark.usefixtures(one_thread.__name__)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """family -> (HF model, pdserve's ModelFiles of the saved folder)."""
    return build_each(FAMILIES, tmp_path_factory)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cache_holds_one_latent_per_token_and_layer(deepseek, family):
    model, files = deepseek[family]
    runner = make_engine(files).runner
    width = model.config.kv_lora_rank + model.config.qk_rope_head_dim
    assert width == 40 and runner.kv_shape == KVShape(tensors=1, heads=1, dim=40)
    assert [tuple(k.shape[1:]) for k in runner.k_caches] == [(4, 1, 40)] * 2  # block_size 4
    assert runner.v_caches == [] and [len(kv) for kv in runner.kv_caches] == [1, 1]
    assert runner.block_bytes == 2 * 4 * 40 * 4  # layers x tokens x latent x float32


@pytest.mark.parametrize("family", FAMILIES)
def test_the_softmax_scale_is_transformers(deepseek, family):
    model, files = deepseek[family]
    assert softmax_scale(files.config) == pytest.approx(model.model.layers[0].self_attn.scaling)
    plain = (16 + 8) ** -0.5
    assert (softmax_scale(files.config) == pytest.approx(plain)) == (family == "deepseek_v2")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_absorbed_decode_equals_the_up_projected_one(deepseek, family):
    """One decode step over contexts of 8, 40 and 11 tokens (two decode groups, padded) in
    both forms: the same logits; then the same greedy tokens over 12 steps."""
    files = deepseek[family][1]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = []
    for absorbed in (True, False):
        engine = make_engine(files, enable_prefix_caching=False)
        for layer in engine.runner.model.layers:
            layer.attn.absorbed = absorbed
        rows, logits = engine.runner.run(decode_batch(engine, CONTEXTS))
        outs.append((rows, logits, run_to_completion(engine, CONTEXTS, params)))
    (rows_a, logits_a, tokens_a), (rows_e, logits_e, tokens_e) = outs
    assert rows_a == rows_e and sorted(rows_a) == [0, 1, 2]
    torch.testing.assert_close(logits_a, logits_e, atol=1e-5, rtol=0)
    assert tokens_a == tokens_e


def test_kv_size_and_the_planner_use_the_engines_latent_arithmetic(deepseek):
    """`pdserve kv-size` / `plan` (sim/kvmath.py) and the engine's cache (model/kv_shape.py) are
    one function: the tiny model's 2 layers x (32 + 8) float32 values, DeepSeek-V3's 61 x
    (512 + 64) bf16 values per token."""
    from pdserve.sim.hardware import get_gpu
    from pdserve.sim.kvmath import kv_bytes_per_token
    from pdserve.sim.kvsize import kv_size_report
    from pdserve.sim.latency import LatencyModel
    from pdserve.sim.models import from_engine_config, get_model, load_hf_config

    files = deepseek["deepseek_v3"][1]
    runner = make_engine(files).runner
    per_token = runner.block_bytes // runner.block_size
    assert per_token == 2 * (32 + 8) * 4 == 320
    for spec in (load_hf_config(files.path / "config.json"), from_engine_config(files.config)):
        assert spec.attention == "MLA" and kv_bytes_per_token(spec, "fp32") == per_token
    report = kv_size_report(spec, 21, "fp32", [])  # `pdserve kv-size --model DIR --dtype fp32`
    assert "MLA: 2 layers x (latent 32 + RoPE key 8) x fp32" in report
    assert "per token   320 B" in report and "21 tokens -> 6,720 B" in report
    planned = LatencyModel(spec, get_gpu("h100"), tp=2, kv_dtype="fp32")  # `pdserve plan`'s
    assert planned.kv_bytes_per_token_gpu == per_token  # every TP rank holds the whole latent
    assert kv_bytes_per_token(get_model("deepseek-v3"), "bf16") == 61 * (512 + 64) * 2 == 70_272


def test_int8_applies_to_the_latent_projections_and_every_expert(deepseek):
    """--weights int8 on DeepSeek-V3: MLA's down-projection, q_b_proj and o_proj (kv_b_proj
    stays dense: decode absorbs its halves), the dense MLP, every routed and shared expert."""
    from pdserve.model.quant import check_format

    model, files = deepseek["deepseek_v3"]
    engine = make_engine(files, weights="int8", enable_prefix_caching=False)
    layers = engine.runner.model.layers
    attn, moe = layers[0].attn, layers[1].mlp
    assert {lin.format for lin in (attn.down, attn.q_up, attn.o)} == {"int8"}
    experts = [*moe.experts, moe.shared]
    assert {lin.format for e in experts for lin in (e.gate_up, e.down)} == {"int8"}
    prompt = list(range(1, 20))
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, -1]
    got = last_logits(engine, prompt)
    assert torch.nn.functional.cosine_similarity(got, ref, 0) > 0.99
    with pytest.raises(ValueError, match="int8 needs every linear's input size divisible by 16"):
        check_format("int8", torch.device("cpu"), 24)  # a q_lora_rank of 24 would crash torch


def test_tensor_and_expert_parallel_ranks_give_the_tokens_of_one(deepseek):
    """DeepSeek-V3 co-located on 2 ranks, experts over 2 groups: each rank holds half of the
    heads (q_b_proj and kv_b_proj rows, o_proj columns), the whole latent, 2 of the 4 experts
    whole and half of the shared one; the tokens are one rank's."""
    files = deepseek["deepseek_v3"][1]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = run_to_completion(make_engine(files), CONTEXTS, params)
    engine = make_engine(files, tensor_parallel_size=2, expert_parallel_size=2)
    try:
        runner = engine.runner
        attn, moe = runner.model.layers[1].attn, runner.model.layers[1].mlp
        assert attn.heads == 2 and runner.kv_shape == KVShape(1, 1, 40)
        assert [e is not None for e in moe.experts] == [True, True, False, False]
        assert moe.shared.down.weight.shape == (64, 16)  # the shared expert split by width
        assert run_to_completion(engine, CONTEXTS, params) == want
    finally:
        engine.close()


def test_a_deepseek_v3_config_as_published_loads_and_fp8_weights_are_refused(deepseek, tmp_path):
    """DeepSeek-V3's own config.json names its routing topk_method "noaux_tc" and scoring_func
    "sigmoid" (what V3 always does) and ships FP8 weights with quantization_config."""
    import json
    import shutil

    from pdserve.model.loader import load_model_config

    src = deepseek["deepseek_v3"][1].path
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw |= {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_model_config(str(tmp_path))[1]
    assert (cfg.router_scoring, cfg.expert_groups, cfg.topk_groups) == ("sigmoid", 2, 1)
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"quantized weights \(config.json quantization_config, "
                       "fp8\\) are not supported"):  # fmt: skip
        load_model_config(str(tmp_path))


def test_an_int8_kv_cache_is_refused_for_the_latent(deepseek):
    """--kv-cache-dtype int8 quantizes K and V rows per KV head; an MLA cache holds one latent,
    and the engine says so at start rather than quantizing what its kernels do not read."""
    with pytest.raises(ValueError, match="MLA"):
        make_engine(deepseek["deepseek_v2"][1], kv_cache_dtype="int8")
