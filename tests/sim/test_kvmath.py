"""The seeds' worked KV-transfer examples, reproduced exactly, plus GQA/MQA/MLA and dtypes."""

import json

import pytest

from pdserve.cli import main
from pdserve.sim.hardware import LINKS, Link, get_gpu, get_link
from pdserve.sim.kvmath import (
    format_bytes,
    format_duration,
    kv_bytes,
    kv_bytes_per_token,
    transfer_time,
)
from pdserve.sim.models import PRESETS, get_model, load_hf_config


def test_llama31_70b_fp16_per_token_and_prompts():
    model = get_model("llama-3.1-70b")
    assert kv_bytes_per_token(model, "fp16") == 327_680  # 320 KiB
    assert kv_bytes(model, 4096, "fp16") == 1_342_177_280  # the seed's "1.31 GB" (KiB x 1e6)
    assert kv_bytes(model, 8192, "fp16") == 2 * 1_342_177_280
    assert format_bytes(1_342_177_280) == ("1,342,177,280 B = 1.342 GB = 1.250 GiB = 1,310,720 KiB")


def test_llama31_70b_4096_over_100gbe_is_about_120_ms():
    t = transfer_time(1_342_177_280, get_link("100gbe"))
    assert get_link("100gbe").practical_bytes_per_s == 11e9
    assert round(t.practical_s, 2) == 0.12  # 122 ms at ~11 GB/s
    assert format_duration(t.practical_s) == "122.0 ms"


def test_llama3_2048_token_examples():
    assert kv_bytes(get_model("llama-3-70b"), 2048, "fp16") == 671_088_640  # "671 MB"
    small = kv_bytes(get_model("llama-3-8b"), 2048, "bf16")
    assert small == 268_435_456  # "268 MB"
    nvlink = transfer_time(small, get_link("nvlink4")).theoretical_s
    hdr = transfer_time(small, get_link("ib-hdr")).theoretical_s
    eth = transfer_time(small, get_link("100gbe")).theoretical_s
    assert (format_duration(nvlink), round(hdr * 1e3), round(eth * 1e3, 1)) == (
        "0.30 ms",  # ~0.3 ms over NVLink 900 GB/s
        11,  # ~11 ms over IB HDR 25 GB/s
        21.5,  # ~21 ms over 100 GbE 12.5 GB/s
    )


def test_gqa_mqa_mla_and_dtypes():
    assert get_model("llama-2-7b").attention == "MHA"
    assert kv_bytes_per_token(get_model("llama-2-7b"), "fp16") == 2 * 32 * 32 * 128 * 2
    falcon = get_model("falcon-7b")
    assert (falcon.attention, kv_bytes_per_token(falcon, "bf16")) == ("MQA", 2 * 32 * 64 * 2)
    ds = get_model("deepseek-v3")
    assert (ds.attention, kv_bytes_per_token(ds, "bf16")) == ("MLA", 61 * 576 * 2)
    kimi = get_model("kimi-k2")  # DeepSeek-V3's attention: the same latent, half the heads
    assert (kimi.attention, kv_bytes_per_token(kimi, "bf16")) == ("MLA", 70_272)
    model = get_model("llama-3.1-70b")
    sizes = [kv_bytes_per_token(model, d) for d in ("fp32", "fp16", "bf16", "fp8", "int4")]
    assert sizes == [655_360, 327_680, 327_680, 163_840, 81_920]


def test_int8_is_pdserve_s_cache_with_a_scale_a_row():
    """`pdserve kv-size --dtype int8` counts what `--kv-cache-dtype int8` allocates: each
    (token, KV head) row of K and V as head_dim int8 values and a float32 scale."""
    from pdserve.model import kv_int8

    model = get_model("llama-3.1-70b")
    per_row = kv_int8.row_width(model.head_dim)  # bytes of one cached row
    expected = model.num_layers * 2 * model.num_kv_heads * per_row
    assert kv_bytes_per_token(model, "int8") == expected == 163_840 + 5_120
    assert kv_bytes(model, 3, "int8") == 3 * expected
    ds = get_model("deepseek-v3")  # no 8-bit latent cache here: plain bytes
    assert kv_bytes_per_token(ds, "int8") == 61 * 576


def test_bad_inputs_say_what_to_fix(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'gpt-9'.*llama-3.1-70b"):
        get_model("gpt-9")
    with pytest.raises(ValueError, match="prompt length must be >= 0"):
        kv_bytes(get_model("llama-3-8b"), -1)
    with pytest.raises(ValueError, match="unknown dtype 'fp12'"):
        kv_bytes_per_token(get_model("llama-3-8b"), "fp12")
    with pytest.raises(ValueError, match="unknown link 'wifi'"):
        get_link("wifi")
    with pytest.raises(ValueError, match="unknown GPU 'tpu'"):
        get_gpu("tpu")
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 64, "vocab_size": 10}))
    with pytest.raises(ValueError, match="lacks num_hidden_layers, num_attention_heads; add it"):
        load_hf_config(bad)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        Link.from_gbps(0)


def test_hf_config_matches_preset(tmp_path):
    cfg = {
        "model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192,
        "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
        "vocab_size": 128256, "tie_word_embeddings": False,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = get_model(str(tmp_path))
    preset = PRESETS["llama-3.1-70b"]
    assert (spec.num_params, spec.head_dim, spec.num_kv_heads) == (preset.num_params, 128, 8)
    assert kv_bytes_per_token(spec, "fp16") == 327_680


def test_hf_config_mla_and_mqa(tmp_path):
    mla = {
        "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "vocab_size": 129280, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
    }  # fmt: skip
    (tmp_path / "mla.json").write_text(json.dumps(mla))
    spec = get_model(str(tmp_path / "mla.json"))
    assert (spec.attention, kv_bytes_per_token(spec, "bf16")) == ("MLA", 70_272)
    mqa = {"n_layer": 32, "hidden_size": 4544, "n_head": 71, "multi_query": True,
           "vocab_size": 65024, "model_type": "falcon"}  # fmt: skip
    (tmp_path / "mqa.json").write_text(json.dumps(mqa))
    assert get_model(str(tmp_path / "mqa.json")).num_kv_heads == 1


def test_kv_size_command_prints_seed_numbers(capsys):
    assert main(["kv-size", "--model", "llama-3.1-70b", "--prompt-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "per token   327,680 B = 327.680 kB = 320.000 KiB" in out
    assert "1,342,177,280 B = 1.342 GB = 1.250 GiB" in out
    row = next(line for line in out.splitlines() if line.startswith("100gbe"))
    assert row.split() == ["100gbe", "12.5", "GB/s", "107.4", "ms", "11", "GB/s", "122.0", "ms"]
    assert len([n for n in LINKS if n in out]) == 12


def test_kv_size_command_one_link_and_errors(capsys):
    assert main(["kv-size", "--model", "llama-3-8b", "--prompt-tokens", "2048",
                 "--bandwidth-gbps", "200"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "268,435,456 B = 268.435 MB = 256.000 MiB" in out
    assert "200gbps" in out and "10.7 ms" in out
    assert main(["kv-size", "--model", "llama-3-8b", "--prompt-tokens", "-5"]) == 2
    assert "prompt length must be >= 0 tokens" in capsys.readouterr().err
