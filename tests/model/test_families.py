"""Every family the registry serves (`model/registry.py`), on tiny random checkpoints built with
transformers' own classes: pdserve's greedy tokens equal transformers' `generate` in float32,
last-token logits within 1e-4; a prefix-cache hit and chunked prefill give the cold run's tokens
(Mistral's prompts run past its sliding window; DeepSeek's read the latent cache); experts take
the int8 format; unknown architectures and tensor parallelism where it cannot work are refused
by name. The dense families decode through the fused C++ step (its logits equal the eager
step's), MoE and multi-head latent attention (`tests/model/test_mla.py`) eagerly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from factories import make_engine, run_to_completion
from family_models import (
    BASE,
    FAMILIES,
    GGUF_ARCH,
    WINDOW,
    build,
    build_each,
    one_thread,
    write_gguf,
)

from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.attention import AttentionMetadata, PrefillSpan
from pdserve.model.loader import load_model_config, load_model_files
from pdserve.model.registry import UnsupportedArchitecture

DENSE = ("qwen2", "qwen3", "mistral")  # the fused decode step serves these; MoE stays eager
MOE_REASON = "the fused step has no Mixture-of-Experts layers"
MLA_REASON = "the fused step has no multi-head latent attention"
EAGER_REASON = {"deepseek_v2": MLA_REASON, "deepseek_v3": MLA_REASON}  # others: MOE_REASON

PROMPTS = [[5, 17, 33, 2, 9, 71, 8], list(range(1, 20)), [200, 3, 3, 3, 250]]  # 19 > WINDOW
NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)
pytestmark = pytest.mark.usefixtures(one_thread.__name__)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (HF model, pdserve's ModelFiles of the saved folder)."""
    return build_each(FAMILIES, tmp_path_factory)


@pytest.fixture(scope="module")
def references(checkpoints):
    """family -> (transformers' greedy tokens per prompt, its last-token logits per prompt)."""
    out = {}
    with torch.no_grad():
        for family, (model, _) in checkpoints.items():
            tokens, logits = [], []
            for p in PROMPTS:
                ids = torch.tensor([p])
                gen = model.generate(ids, max_new_tokens=NEW, do_sample=False)
                tokens.append(gen[0, len(p) :].tolist())
                logits.append(model(ids).logits[0, -1])
            out[family] = tokens, logits
    return out


def last_logits(engine, prompt: list[int]) -> torch.Tensor:
    """pdserve's logits after `prompt`, one fresh prefill span in blocks 0, 1, ..."""
    runner, n = engine.runner, len(prompt)
    table = torch.arange(-(-n // runner.block_size))
    meta = AttentionMetadata(torch.arange(n), 0, [], [PrefillSpan(0, n, n, table, True)])
    with torch.inference_mode():
        hidden = runner.forward(torch.tensor(prompt), torch.arange(n), meta)
        return runner.model.logits(hidden[-1:])[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logits_equal_transformers(checkpoints, references, family):
    files = checkpoints[family][1]
    assert files.config.architecture == family  # from config.json, not the folder's name
    tokens, logits = references[family]
    engine = make_engine(files, enable_prefix_caching=False)
    assert run_to_completion(engine, PROMPTS, GREEDY) == tokens
    if family in DENSE:
        assert engine.runner.decode_path.startswith("fused ("), engine.runner.decode_path
    else:  # and says why
        why = EAGER_REASON.get(family, MOE_REASON)
        assert engine.runner.decode_path == f"eager ({family}: {why})"
    for p, ref in zip(PROMPTS, logits, strict=True):
        torch.testing.assert_close(last_logits(engine, p), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "family", ["mistral", "qwen3", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3"]
)
def test_prefix_hits_and_chunked_prefill_give_the_cold_tokens(checkpoints, references, family):
    files = checkpoints[family][1]
    cold = references[family][0]
    warm = make_engine(files)
    run_to_completion(warm, PROMPTS, GREEDY)  # fills the prefix cache
    extended = [p + [7] for p in PROMPTS]  # hits every full block the first run cached
    hits = warm.block_manager.hits
    assert run_to_completion(warm, PROMPTS, GREEDY) == cold
    assert warm.block_manager.hits - hits >= 16  # the 19-token prompt's 4 blocks, past WINDOW
    for chunk in (3, 8):
        chunked = make_engine(files, chunk_size=chunk, enable_prefix_caching=False)
        assert run_to_completion(chunked, PROMPTS, GREEDY) == cold
    fresh = make_engine(files, enable_prefix_caching=False)
    assert run_to_completion(warm, extended, GREEDY) == run_to_completion(fresh, extended, GREEDY)


@pytest.mark.parametrize("eager", [True, False])
def test_the_sliding_window_is_what_makes_mistral_match(checkpoints, references, eager):
    """Past the window, attending to every position gives other tokens: the window is tested,
    in the eager model and in the fused step."""
    import dataclasses

    files = checkpoints["mistral"][1]
    unwindowed = files._replace(config=dataclasses.replace(files.config, sliding_window=None))
    engine = make_engine(unwindowed, enable_prefix_caching=False, enforce_eager=eager)
    assert (engine.runner.fused is None) == eager
    assert len(PROMPTS[1]) > WINDOW
    assert run_to_completion(engine, PROMPTS[1:2], GREEDY) != references["mistral"][0][1:2]


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.1)])
@pytest.mark.parametrize("family", DENSE)
def test_the_fused_step_equals_the_eager_one(checkpoints, family, dtype, tol):
    """q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), the sliding window (Mistral: the
    39- and 10-token contexts run past it, the 7-token one not) in the fused step: one decode
    step's logits and K/V as the eager step's; in float32 the same greedy tokens over 24 steps
    (the window moves as they decode)."""
    from model.test_fused_decode import PROMPTS as CONTEXTS
    from model.test_fused_decode import decode_batch

    files = checkpoints[family][1]
    fused = make_engine(files, dtype=dtype, enable_prefix_caching=False)
    eager = make_engine(files, dtype=dtype, enable_prefix_caching=False, enforce_eager=True)
    assert fused.runner.decode_path.startswith("fused (") and eager.runner.fused is None
    outs = []
    for eng in (fused, eager):
        rows, logits = eng.runner.run(decode_batch(eng, CONTEXTS))
        assert sorted(rows) == [0, 1, 2]  # eager returns them shortest context first
        outs.append((logits[torch.tensor(rows).argsort()], eng.runner.k_caches[1].clone()))
    (lf, kf), (le, ke) = outs
    assert (lf - le).abs().max().item() < tol
    assert (kf.float() - ke.float()).abs().max().item() < tol  # k after its bias, norm, RoPE
    if dtype == "float32":
        assert (lf.argmax(-1) == le.argmax(-1)).all()
        steps = SamplingParams(max_tokens=3 * WINDOW, ignore_eos=True)
        prompts = [PROMPTS[0], PROMPTS[2][:3]]
        fused = make_engine(files, enable_prefix_caching=False)
        eager = make_engine(files, enable_prefix_caching=False, enforce_eager=True)
        want = run_to_completion(eager, prompts, steps)
        assert run_to_completion(fused, prompts, steps) == want


def test_attention_parts_the_fused_step_cannot_apply_keep_a_model_eager():
    from pdserve.model.fused import unfused_parts
    from pdserve.model.parts import HeadQKNorm, QKVBias, WideQKNorm

    bias, head, wide = (object.__new__(c) for c in (QKVBias, HeadQKNorm, WideQKNorm))
    assert unfused_parts([]) is None and unfused_parts([bias, head]) is None
    assert unfused_parts([head]) is None
    assert unfused_parts([bias, wide]) == "the fused step has no WideQKNorm"
    assert unfused_parts([head, bias]) == "the fused step applies QKVBias, HeadQKNorm in order"


def test_int8_applies_to_every_expert(checkpoints, references):
    files = checkpoints["qwen3_moe"][1]
    engine = make_engine(files, weights="int8", enable_prefix_caching=False)
    moe = engine.runner.model.layers[0].mlp
    formats = {lin.format for e in moe.experts for lin in (e.gate_up, e.down)}
    assert formats == {"int8"}
    got, ref = last_logits(engine, PROMPTS[1]), references["qwen3_moe"][1][1]
    assert torch.nn.functional.cosine_similarity(got, ref, 0) > 0.99


def test_an_unknown_architecture_is_refused_naming_it_and_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"})
    )
    with pytest.raises(UnsupportedArchitecture) as err:
        load_model_config(str(tmp_path))
    assert "FooForCausalLM" in str(err.value)
    assert all(a in str(err.value) for a in ("Qwen3MoeForCausalLM", "MistralForCausalLM"))


def test_serve_refuses_an_unknown_architecture_at_start_up(tmp_path):
    from servers import run_serve

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    out = run_serve("--model", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "architecture FooForCausalLM is not supported" in out.stderr


def test_olmoe_refuses_tensor_parallelism_by_name(checkpoints):
    from pdserve.engine.tp.shard import TPShard

    with pytest.raises(ValueError, match="olmoe does not run tensor-parallel"):
        TPShard(0, 2).check(checkpoints["olmoe"][1].config)
    TPShard(0, 2).check(checkpoints["qwen3_moe"][1].config)  # experts split by their width


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size", "norm_topk_prob", "dense_layers")  # fmt: skip


@pytest.mark.parametrize("family", GGUF_ARCH)
def test_a_gguf_file_serves_as_its_hf_folder(checkpoints, references, family, tmp_path,
                                             monkeypatch):  # fmt: skip
    """A GGUF written as llama.cpp writes it (Mixtral as `llama` with stacked experts and
    permuted q/k, Qwen2-MoE with its shared expert, Qwen2-MoE's layer 1 dense) gives the HF
    folder's config and weights, transformers' greedy tokens and its logits within 1e-4."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model, hf = checkpoints[family]
    write_gguf(family, model.config, hf.weights, tmp_path / "m.gguf")
    files = load_model_files(str(tmp_path / "m.gguf"))
    assert files.config.architecture == family
    for field in MOE_FIELDS:
        assert getattr(files.config, field) == getattr(hf.config, field), field
    assert files.weights.keys() == hf.weights.keys()
    for name, w in hf.weights.items():  # q/k rows un-permuted, experts split back
        assert (files.weights[name] == w).all(), name
    engine = make_engine(files, enable_prefix_caching=False)
    tokens, logits = references[family]
    assert run_to_completion(engine, PROMPTS, GREEDY) == tokens
    torch.testing.assert_close(last_logits(engine, PROMPTS[1]), logits[1], atol=1e-4, rtol=0)


def test_q4_0_experts_and_permuted_qk_keep_their_4_bit_blocks(checkpoints, tmp_path, monkeypatch):
    """`--weights int4` takes a Q4_0 GGUF's own blocks for every expert (split from the stacked
    tensor) and for Mixtral's q/k (rows un-permuted): they equal the dequantized weights."""
    from model.test_quant import dequantize
    from pdserve.model.loader import load_int4_blocks

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model, hf = checkpoints["mixtral"]
    write_gguf("mixtral", model.config, hf.weights, tmp_path / "m.gguf", qtype="Q4_0")
    files = load_model_files(str(tmp_path / "m.gguf"))
    blocks = load_int4_blocks(files)
    linears = {
        n for n, w in hf.weights.items() if w.ndim == 2 and ".layers." in n and "gate." not in n
    }
    assert blocks.keys() == linears  # every expert of every layer, q, k, v, o
    for name in linears:
        assert np.array_equal(dequantize(blocks[name]), files.weights[name]), name


def test_expert_parallelism_is_refused_where_it_cannot_split(checkpoints):
    from pdserve.config import EngineConfig
    from pdserve.engine.tp.shard import TPShard

    with pytest.raises(ValueError, match="qwen3 is a dense model"):
        TPShard(0, 2, 2).check(checkpoints["qwen3"][1].config)
    with pytest.raises(ValueError, match="does not divide the 4 experts; sizes that work"):
        TPShard(0, 3, 3).check(checkpoints["mixtral"][1].config)
    with pytest.raises(ValueError, match="--expert-parallel-size 2 must divide"):
        EngineConfig(tensor_parallel_size=1, expert_parallel_size=2)
    moe = checkpoints["qwen3_moe"][1].config
    assert [TPShard(r, 2, 2).experts(moe) for r in range(2)] == [range(0, 2), range(2, 4)]
    weights = TPShard(1, 2, 2).weights(moe, checkpoints["qwen3_moe"][1].weights)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in weights  # whole, its own
    assert "model.layers.0.mlp.experts.0.up_proj.weight" not in weights


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
         "beta_fast": 16, "mscale": 1.0, "mscale_all_dim": 0.5},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
    ],
)  # fmt: skip
def test_rope_scaling_equals_transformers(scaling):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pdserve.config import RopeScaling
    from pdserve.model.rope import rope_inv_freq

    theta = 1e6
    config = transformers.Qwen2Config(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
        rope_parameters={"rope_theta": theta, **scaling},
    )  # fmt: skip
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    inv, factor = rope_inv_freq(16, theta, RopeScaling.from_hf(config.rope_parameters), None)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor)


def test_plain_rope_has_no_scaling_and_an_unknown_scaling_is_refused_by_name():
    from pdserve.config import RopeScaling

    assert RopeScaling.from_hf(None) is None
    assert RopeScaling.from_hf({"rope_type": "default", "rope_theta": 1e4}) is None
    assert RopeScaling.from_hf({"type": "linear", "factor": 2.0}) == RopeScaling(
        factor=2.0, rope_type="linear"
    )  # transformers < 5 names it `type`
    with pytest.raises(ValueError, match="'dynamic' is not supported.*llama3, yarn, linear"):
        RopeScaling.from_hf({"rope_type": "dynamic", "factor": 2.0})


def test_biases_the_decoder_does_not_add_are_refused_not_ignored(tmp_path):
    import transformers

    config = transformers.LlamaConfig(**{**BASE, "attention_bias": True})
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="llama with a bias on o_proj"):
        make_engine(load_model_files(str(tmp_path)))


def test_speculative_rows_through_the_fused_step_keep_mistrals_window(checkpoints, references):
    """A sequence verifying k proposals is k+1 fused rows at consecutive positions: each attends
    to its own last WINDOW positions, so the tokens are transformers'."""
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "disable_by_batch_size": len(PROMPTS),
    }  # every sequence speculates
    files = checkpoints["mistral"][1]
    engine = make_engine(files, enable_prefix_caching=False, speculative_config=json.dumps(spec))
    assert engine.runner.fused is not None
    assert run_to_completion(engine, PROMPTS, GREEDY) == references["mistral"][0]
    assert engine.stats()["spec_verify_steps"] > 0


def test_the_eos_ids_come_from_config_then_generation_config_then_the_tokenizer(tmp_path):
    """As transformers finds them: a folder whose config.json names no eos still stops."""
    import shutil

    from pdserve.model.loader import load_tokenizer

    build("qwen3", tmp_path)  # config.json: eos_token_id null
    for f in load_tokenizer().path.parent.iterdir():
        shutil.copy(f, tmp_path / f.name)
    im_end = load_tokenizer().eos_token_id
    assert load_model_config(str(tmp_path))[1].eos_token_ids == (im_end,)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [7, 9]}))
    assert load_model_config(str(tmp_path))[1].eos_token_ids == (7, 9)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": 5}))
    assert load_model_config(str(tmp_path))[1].eos_token_ids == (5,)
