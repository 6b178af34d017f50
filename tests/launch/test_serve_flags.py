"""`pdserve serve` refuses bad flag values before starting anything, saying what to change."""

from __future__ import annotations

import pytest
from servers import run_serve


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--decode-chunk-size", "10"], "--decode-chunk-size must be 0 (off) or at least"),
        (["--slo-ttft", "0"], "--slo-ttft must be a positive number of seconds"),
        (["--slo-tpot", "-1"], "--slo-tpot must be a positive number of seconds"),
        (["--kv-compression", "fp8", "--kv-transport", "nixl"], "needs --kv-transport tcp"),
        (["--prefill-args", "--chunk-size 1024 --bogus 1"], "--bogus 1 is not an engine flag"),
        (["--launcher", "ray", "--decode-resources", "{CPU: 1}"], "--decode-resources: not JSON"),
        (["--mode", "disagg", "--decode-tp", "2", "--decode-ep", "3"], "3 must divide"),
        (["--mode", "disagg", "--decode-tp", "3", "--decode-ep", "3"], "llama is a dense model"),
        (["--prefill-pp", "31"], "--pipeline-parallel-size 31 is larger than the model's 30"),
        (["--prefill-pp", "2", "--pp-layer-partition", "15,14"], "adds up to 29 layers"),
        (["--decode-pp", "2"], "pipeline parallelism is for the prefill pool"),
        (["--pp-layer-partition", "15,15"], "add --prefill-pp N"),
        (["--launcher", "ray", "--prefill-pp", "2", "--kv-store"], "--kv-store with --prefill-pp"),
        (["--prefill-pp", "2", "--prefill-tp", "3", "--kv-store"], "or with TP stages"),
        (["--launcher", "ray", "--prefill-pp", "2", "--prefill-tp", "3"], "not placed by Ray"),
    ],
)
def test_bad_flags_exit_2_with_a_message(flags, message):
    out = run_serve(*flags)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr


def test_several_gpus_give_each_worker_its_own():
    from pdserve.launch.local import gpu_per_worker

    assert gpu_per_worker("auto", 2, gpus=2) == ["cuda:0", "cuda:1"]  # 1 P + 1 D
    assert gpu_per_worker("cuda", 3, gpus=2) == ["cuda:0", "cuda:1", "cuda:0"]
    assert gpu_per_worker("auto", 2, gpus=1) == [None, None]  # the workers' own --device
    assert gpu_per_worker("auto", 2, gpus=0) == [None, None]
    assert gpu_per_worker("cuda:3", 2, gpus=8) == [None, None]  # asked for one GPU: all on it
    assert gpu_per_worker("cpu", 2, gpus=8) == [None, None]


@pytest.mark.parametrize(
    ("env", "gpus"), [("0,1", 2), ("3", 1), ("", 0), ("-1", 0), (" 2 , 5 ,", 2)]
)
def test_visible_gpus_follows_cuda_visible_devices(monkeypatch, env, gpus):
    from pdserve.launch.local import visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert visible_gpus() == gpus
