"""Model presets of the Qwen3 and Mixtral families in the planner: exact KV bytes, MoE's
active-parameter FLOPs against its full-parameter memory, and expert parallelism per phase."""

import json

import pytest

from pdserve.bench.metrics import SLO
from pdserve.bench.workload import LengthDist, Workload
from pdserve.sim.deployment import Cluster, Deployment
from pdserve.sim.hardware import get_gpu, get_link
from pdserve.sim.kvmath import kv_bytes, kv_bytes_per_token
from pdserve.sim.latency import Batch, LatencyModel
from pdserve.sim.models import get_model, load_hf_config
from pdserve.sim.planner import PlanRequest
from pdserve.sim.report import serve_command
from pdserve.sim.shapes import Shape, valid_shapes


@pytest.mark.parametrize(
    ("name", "layers", "kv_heads"),
    [("qwen3-8b", 36, 8), ("qwen3-32b", 64, 8), ("qwen3-235b-a22b", 94, 4),
     ("mixtral-8x7b", 32, 8)],
)  # fmt: skip
def test_kv_bytes_per_token_are_2_x_layers_x_kv_heads_x_head_dim_x_2_bytes(name, layers, kv_heads):
    # head_dim is 128 in all four; Qwen3-32B's 5120 / 64 heads would say 80, its config 128.
    model = get_model(name)
    assert kv_bytes_per_token(model, "bf16") == 2 * layers * kv_heads * 128 * 2
    assert kv_bytes(model, 4096, "fp8") == 2 * layers * kv_heads * 128 * 4096


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [("qwen3-8b", 8.19e9, None), ("qwen3-32b", 32.8e9, None),
     ("qwen3-235b-a22b", 235.1e9, 22.2e9), ("mixtral-8x7b", 46.7e9, 12.9e9)],
)  # fmt: skip
def test_parameter_counts_match_the_model_cards(name, total, active):
    model = get_model(name)
    assert model.num_params == pytest.approx(total, rel=2e-3)
    assert model.active_params == (active and pytest.approx(active, rel=2e-3))


def test_a_moe_multiplies_its_active_weights_but_holds_all_of_them():
    model, h100 = get_model("qwen3-235b-a22b"), get_gpu("h200")
    lat = LatencyModel(model, h100, tp=8)
    assert lat.weight_bytes == model.num_params * 2  # every expert in memory
    tokens = 1000
    work = lat.work(Batch(tokens, 1, 0, 0, 1))
    head = 2 * model.vocab_size * model.hidden_size
    assert work.gemm_flops == 2 * (model.active_params - model.embedding_params) * tokens + head
    # A decode step of one token reads 8 of 128 experts; a big batch touches them all.
    one, many = lat.weights_read(1), lat.weights_read(4096)
    expert = model.expert_params * 2 / 8
    assert one == pytest.approx(lat.weights_read(0) - expert * (1 - 8 / 128))
    assert many == pytest.approx(lat.weights_read(0), rel=1e-6)


def test_expert_parallelism_splits_experts_and_keeps_kv_per_attention_group():
    model, gpu = get_model("qwen3-235b-a22b"), get_gpu("h200")
    tp8, ep8 = LatencyModel(model, gpu, tp=8), LatencyModel(model, gpu, tp=1, ep=8)
    assert (tp8.gpus, ep8.gpus, ep8.dp) == (8, 8, 8)
    expert = model.expert_params * 2
    dense = model.num_params * 2 - expert
    assert tp8._dense_w + tp8._expert_w == pytest.approx(dense / 8 + expert / 8)
    assert ep8._dense_w + ep8._expert_w == pytest.approx(dense + expert / 8)
    # TP 8 over 4 KV heads keeps each head twice; 8 data-parallel groups keep none twice.
    kv = kv_bytes_per_token(model, "bf16")
    assert tp8.kv_bytes_per_token_gpu == kv / 4
    assert ep8.kv_bytes_per_token_gpu == kv / 8
    free_ep8 = gpu.mem_bytes * 0.9 - dense - expert / 8
    assert ep8.kv_capacity_tokens == int(free_ep8 / (kv / 8))


@pytest.mark.parametrize(
    ("model", "tp", "ep", "message"),
    [("qwen3-32b", 1, 2, "needs a mixture-of-experts model; qwen3-32b is dense"),
     ("mixtral-8x7b", 1, 16, "EP 16 does not divide mixtral-8x7b's 8 experts"),
     ("mixtral-8x7b", 4, 2, "EP 2 must be a multiple of TP 4")],
)  # fmt: skip
def test_ep_layouts_that_cannot_exist_are_refused_by_name(model, tp, ep, message):
    with pytest.raises(ValueError, match=message):
        LatencyModel(get_model(model), get_gpu("h100"), tp=tp, ep=ep)
    with pytest.raises(ValueError, match="--decode-ep 2 must be a multiple of --decode-tp 4"):
        Deployment("disagg", decode_tp=4, decode_ep=2)


def test_the_search_offers_ep_for_moe_only_and_the_plan_says_the_flag():
    work = Workload.from_lengths(LengthDist.parse("2048"), LengthDist.parse("256"))
    moe = Cluster(get_model("qwen3-235b-a22b"), get_gpu("h200"), get_link("ib-ndr"))
    dense = Cluster(get_model("qwen3-32b"), get_gpu("h200"), get_link("ib-ndr"))
    # 470 GB of weights: 4 or 8 H200s hold them with TP; with EP every GPU also holds all
    # 16 GB of dense weights, so only EP 8 fits (EP 4: 16 + 114 GB > 0.9 x 141 GB).
    assert valid_shapes(moe, work, None) == [Shape(4), Shape(8), Shape(1, 8)]
    assert all(s.ep == 1 for s in valid_shapes(dense, work, None))
    dep = Deployment("disagg", prefill_tp=8, decode_tp=1, decode_ep=8)
    assert dep.num_gpus == 16
    assert "--prefill-tp 8 --decode-tp 1 --decode-ep 8" in serve_command(dep)[0]
    PlanRequest(moe, work, 1.0, SLO(2, 0.1))  # a valid request for the search


def test_qwen3_moe_config_json_is_read_with_its_experts(tmp_path):
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "num_hidden_layers": 94, "hidden_size": 4096, "num_attention_heads": 64,
           "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288,
           "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
           "vocab_size": 151936, "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec, preset = load_hf_config(tmp_path / "config.json"), get_model("qwen3-235b-a22b")
    assert (spec.num_experts, spec.experts_per_token, spec.qk_norm) == (128, 8, True)
    assert (spec.num_params, spec.active_params) == (preset.num_params, preset.active_params)
    assert kv_bytes_per_token(spec) == kv_bytes_per_token(preset)
