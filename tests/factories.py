"""Factories for tests: tiny random Llama models, engine configs and sequences."""

from __future__ import annotations

import time

import numpy as np

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.model.loader import ModelFiles


def make_model_config(**overrides) -> ModelConfig:
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=512,
        rope_theta=10000.0,
        eos_token_ids=(0,),
    )
    return ModelConfig(**{**base, **overrides})


def make_model_files(seed: int = 0, **overrides) -> ModelFiles:
    """Random weights in HF naming, scaled so activations stay O(1)."""
    cfg = make_model_config(**overrides)
    rng = np.random.default_rng(seed)
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": w(cfg.vocab_size, d),
        "model.norm.weight": np.ones(d, np.float32),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
            p + "self_attn.q_proj.weight": w(cfg.num_heads * hd, d),
            p + "self_attn.k_proj.weight": w(cfg.num_kv_heads * hd, d),
            p + "self_attn.v_proj.weight": w(cfg.num_kv_heads * hd, d),
            p + "self_attn.o_proj.weight": w(d, cfg.num_heads * hd),
            p + "mlp.gate_proj.weight": w(f, d),
            p + "mlp.up_proj.weight": w(f, d),
            p + "mlp.down_proj.weight": w(d, f),
        }
    return ModelFiles(path=None, config=cfg, weights=weights, fingerprint=f"tiny-{seed}")


def make_engine_config(**overrides) -> EngineConfig:
    # Unquantized weights: every batching variant must give the same tokens, and a quantized
    # linear picks its kernel by batch size (tests/model/test_quant.py covers the formats).
    base = dict(
        dtype="float32",
        device="cpu",
        weights="bf16",
        kv_cache_gb=0.001,
        block_size=4,
        max_num_seqs=8,
    )
    return EngineConfig(**{**base, **overrides})


def make_engine(files: ModelFiles | None = None, **overrides):
    from pdserve.engine.llm_engine import LLMEngine

    return LLMEngine(make_engine_config(**overrides), files or make_model_files())


def make_sequence(token_ids, request_id: str = "r0", **params) -> Sequence:
    return Sequence(request_id, list(token_ids), SamplingParams(**params))


def run_to_completion(engine, prompts, params: SamplingParams) -> list[list[int]]:
    """Output token ids per prompt after stepping the engine until idle."""
    seqs = [engine.add_request(list(p), params) for p in prompts]
    while engine.has_work():
        engine.step()
    return [s.output_token_ids for s in seqs]


def spin(us: float) -> None:
    """Busy-wait `us` microseconds: a fake kernel of a known cost for the kernel-choice tests."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def hand_off(p_engine, d_engine, sender, receiver, prompt, params, rid="r0", whole=False):
    """One prompt through a prefill engine into a decode engine, in this process, as the
    router would relay it (Admit -> Placement -> Prefill -> pushed -> KVReady -> decode):
    returns (tokens the decode side emitted, the prefill side's PrefillDone, the Placement).
    `whole`: the prefill side's --kv-push whole. The sides stay connected to the engines; the
    caller closes sender, receiver and engines."""
    from pdserve.protocol import messages as m
    from pdserve.serving.build import kv_layout
    from pdserve.serving.decode_side import DecodeSide
    from pdserve.serving.prefill_side import PrefillSide

    d_sent, p_sent = [], []
    decode = DecodeSide(d_engine, kv_layout(d_engine), d_sent.append, "d0", receiver)
    prefill = PrefillSide(p_engine, sender, p_sent.append, transfer_timeout_s=60, whole=whole)
    d_engine.connect(decode)
    p_engine.connect(prefill)
    decode.on_admit(m.Admit(rid, prompt, params, remote_prefill=True, lease_s=120))
    [placement] = d_sent
    prefill.on_prefill(m.Prefill(rid, prompt, params, placement.kv_endpoints,
                                 placement.block_ids, placement.num_cached_tokens))  # fmt: skip
    while p_engine.has_work():
        prefill.finish(p_engine.step())
    while prefill.pushing:
        prefill.wait_settle(0.05)
    [done] = p_sent
    d_sent.clear()
    decode.on_kv_ready(m.KVReady(rid, done.first_token))
    while d_engine.has_work():
        decode.emit(d_engine.step())
    tokens = [i.token for msg in d_sent if isinstance(msg, m.Tokens) for i in msg.items]
    return tokens, done, placement
