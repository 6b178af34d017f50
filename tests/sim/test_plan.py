"""`pdserve plan` reproduces the seeds' decision matrix as outcomes of the simulation."""

import json

import pytest

from pdserve.cli import main

BASE = ["plan", "--model", "llama-3.1-70b", "--gpu", "h100", "--slo-ttft", "0.5",
        "--slo-tpot", "0.025", "--json"]  # fmt: skip
LONG = ["--link", "ib-ndr", "--prompt-tokens", "4096", "--output-tokens", "256"]


def run_plan(capsys, *extra: str) -> tuple[int, dict]:
    code = main([*BASE, *extra])
    return code, json.loads(capsys.readouterr().out)


def test_short_prompts_on_25gbe_stay_colocated(capsys):
    code, out = run_plan(capsys, "--link", "25gbe", "--prompt-tokens", "256",
                         "--output-tokens", "256", "--rate", "20")  # fmt: skip
    rec = out["recommendation"]
    assert (code, rec["deployment"]["mode"]) == (0, "colocated")
    assert rec["slo_attainment"] >= 0.9
    # The shared 25 GbE port is why: disaggregation needs more GPUs to move the KV in time.
    best_disagg = min(
        (c for c in out["runner_ups"] if c["deployment"]["mode"] == "disagg"),
        key=lambda c: c["num_gpus"],
        default=None,
    )
    assert best_disagg is None or best_disagg["num_gpus"] >= rec["num_gpus"]


def test_long_prompts_strict_slos_fast_fabric_disaggregate(capsys):
    code, out = run_plan(capsys, *LONG, "--rate", "10")
    rec = out["recommendation"]
    assert (code, rec["deployment"]["mode"]) == (0, "disagg")
    assert rec["slo_attainment"] >= 0.9
    assert any("KV transfer of a 4,096-token prompt (1.34 GB) over ib-ndr" in r
               for r in out["reasons"])  # fmt: skip


def test_low_traffic_stays_colocated(capsys):
    code, out = run_plan(capsys, *LONG, "--rate", "0.2")
    rec = out["recommendation"]
    assert (code, rec["deployment"]["mode"], rec["num_gpus"]) == (0, "colocated", 4)
    idle = [r for r in out["reasons"] if r.startswith("disaggregated needs separate pools")]
    assert len(idle) == 1


def test_impossible_slos_name_the_closest_configuration(capsys):
    code = main([*BASE[:-1], *LONG, "--rate", "1", "--slo-ttft", "0.01", "--requests", "40"])
    out = capsys.readouterr().out
    assert code == 1
    assert "no configuration meets these SLOs" in out
    assert "closest: co-located 1 x TP8" in out
    assert "to fix: relax --slo-ttft >= " in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
        (["--gpu", "tpu-v9"], "unknown GPU 'tpu-v9'"),
        (["--link", "carrier-pigeon"], "unknown link 'carrier-pigeon'"),
        (["--prompt-tokens", "-5"], "bad length distribution '-5'"),
        (["--rate", "0"], "--rate must be a finite number"),
        (["--slo-ttft", "-1"], "SLO target ttft_s must be > 0"),
        (["--gpu", "cpu"], "--gpu cpu needs --profile"),
    ],
)
def test_bad_input_says_what_to_fix(capsys, args, message):
    argv = ["plan", "--model", "llama-3-8b", "--rate", "1", *args]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_recommendation_comes_with_the_serve_command_that_deploys_it(capsys):
    import shlex

    from pdserve.cli import build_parser
    from pdserve.sim.deployment import Deployment
    from pdserve.sim.report import serve_command

    cmd, _ = serve_command(Deployment("disagg", num_prefill=3, num_decode=2, decode_chunk=64))
    assert "--prefill 3 --decode 2 --local-prefill-threshold 0" in cmd
    assert "--decode-chunk-size 64" in cmd
    cmd2, _ = serve_command(Deployment("colocated", replicas=2, chunk=512))
    assert "--colocated-workers 2 --chunk-size 512" in cmd2
    cmd3, note = serve_command(Deployment("disagg", prefill_tp=8, decode_tp=4))
    assert "--prefill-tp 8 --decode-tp 4" in cmd3 and "re-sharded" in note
    for c in (cmd, cmd2, cmd3):  # flags `pdserve serve` accepts
        build_parser().parse_args(shlex.split(c)[1:])
    code, out = run_plan(capsys, *LONG, "--rate", "10")  # 3P x TP8 : 2D x TP4
    assert "--prefill 3 --decode 2" in out["serve_command"]
    assert "--prefill-tp 8 --decode-tp 4" in out["serve_command"]
    [phase] = [r for r in out["reasons"] if r.startswith("per-phase TP (prefill TP8, decode TP4)")]
    assert "against the best with one TP for both phases, disaggregated" in phase
    code, out = run_plan(capsys, *LONG, "--rate", "0.2")  # co-located 1 x TP4
    assert out["serve_command"].startswith("pdserve serve --mode colocated")


# MLA moves the line (docs/sim.md): the same long-prompt workload on H200 at 20 req/s
H200_LONG = ["--gpu", "h200", "--prompt-tokens", "4096", "--output-tokens", "256", "--rate", "20"]
DEEPSEEK_FP8 = ["--model", "deepseek-v3", "--dtype", "fp8", "--kv-dtype", "bf16"]


@pytest.mark.parametrize(
    ("model", "link", "mode"),
    [
        (DEEPSEEK_FP8, "100gbe", "disagg"),  # its 0.29 GB latent per prompt fits a shared port
        (DEEPSEEK_FP8, "25gbe", "colocated"),
        (["--model", "llama-3.1-70b"], "100gbe", "colocated"),  # 1.34 GB per prompt does not
        (["--model", "llama-3.1-70b"], "ib-ndr", "disagg"),
    ],
)
def test_an_mla_model_disaggregates_over_a_slower_link_than_llama(capsys, model, link, mode):
    code, out = run_plan(capsys, *model, *H200_LONG, "--link", link)
    rec = out["recommendation"]
    assert (code, rec["deployment"]["mode"]) == (0, mode)
    assert rec["slo_attainment"] >= 0.9
    other = [c for c in out["runner_ups"] if c["deployment"]["mode"] != mode]
    assert all(c["num_gpus"] >= rec["num_gpus"] for c in other)
