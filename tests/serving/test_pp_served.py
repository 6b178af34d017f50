"""`pdserve serve --prefill-pp 2` on a tiny random Qwen3 folder (4 layers, float32, split 1,3):
one prefill worker of 2 stages pushes into one decode worker, each stage from its own process.
Greedy tokens equal transformers' `generate`; stage 1 killed (kill -9) while the prefill worker
waits on it mid-prompt: the prefill worker exits (`StageLost`), the decode worker prefills the
request itself and it completes with the same tokens, nothing leaks, and serve's supervision
restarts the worker with its stages, which then serves remotely again.
(Refusals at start-up: tests/launch/test_serve_flags.py.)"""

from __future__ import annotations

import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from chaos.cluster import complete
from family_models import build
from servers import Server, children, cmdline, exited, metric, metric_sum, tcp_sockets
from waiting import wait_until

from pdserve.model.loader import load_tokenizer

pytestmark = pytest.mark.slow
N = 8
PROMPT = list(range(300, 400))  # 100 tokens: 7 chunks of 16
REMOTE = 'pdserve_prefill_decisions_total{where="remote"}'
KV_BYTES = "pdserve_kv_transfer_bytes_total"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-4l")
    tokenizer = load_tokenizer()
    for f in tokenizer.path.parent.iterdir():
        shutil.copy(f, folder / f.name)
    model = build("qwen3", folder, vocab_size=tokenizer.vocab_size, num_hidden_layers=4,
                  max_position_embeddings=1024)  # fmt: skip
    return folder, model


@pytest.fixture(scope="module")
def server(folder):
    with Server(
        "--model", str(folder[0]), "--model-name", "tiny", "--mode", "disagg",
        "--prefill", "1", "--decode", "1", "--prefill-pp", "2", "--pp-layer-partition", "1,3",
        "--dtype", "float32", "--local-prefill-threshold", "0", "--heartbeat-timeout-s", "2",
        "--kv-cache-gb", "0.1", "--prefill-args", "--chunk-size 16",
    ) as server:  # fmt: skip
        yield server


def expected(model, prompt: list[int]) -> str:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False)
    return load_tokenizer().decode(out[0, len(prompt) :].tolist())


def ask(server, prompt: list[int]):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": N, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return complete(server.url, body, timeout_s=60)


def stage_pids(pid: int) -> list[int]:
    """The later stages' pids of the prefill worker `pid`."""
    return [c for c in children(pid) if "pdserve.engine.pp" in cmdline(c)]


def test_greedy_tokens_equal_transformers_through_the_pipeline(server, folder):
    remote, kv = (
        metric(server.url, REMOTE),
        metric_sum(server.url, "pdserve_kv_transfer_bytes_total"),
    )
    out = ask(server, PROMPT)
    assert (out.kind, out.text) == ("ok", expected(folder[1], PROMPT))
    assert metric(server.url, REMOTE) == remote + 1  # prefilled by the pipeline
    assert metric_sum(server.url, KV_BYTES) > kv
    pids = server.worker_pids()
    [stage] = stage_pids(pids["prefill-0"])
    # the stage pushed its layers itself: it holds a connection of its own to the decode
    # worker's KV receiver (stage 0 holds another)
    listening = {port for port, _, state in tcp_sockets(pids["decode-1"]) if state == "LISTEN"}
    for pid in (stage, pids["prefill-0"]):
        assert any(remote in listening and state == "ESTABLISHED"
                   for _, remote, state in tcp_sockets(pid)), pid  # fmt: skip
    server.wait_idle_and_clean()


def test_a_stage_killed_mid_prompt_fails_only_its_worker_which_comes_back(server, folder):
    prompt = list(range(500, 600))
    pid = server.worker_pids()["prefill-0"]
    [stage] = stage_pids(pid)
    failures = metric(server.url, "pdserve_worker_failures_total")
    os.kill(stage, signal.SIGSTOP)  # stage 0 sends the chunks on, then waits for the last
    try:
        placed = metric_sum(server.url, "pdserve_prefill_decisions_total")
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(ask, server, prompt)
            wait_until(lambda: metric_sum(server.url, "pdserve_prefill_decisions_total") > placed,
                       30, "the router to place the request")  # fmt: skip
            os.kill(stage, signal.SIGKILL)
            out = future.result()
    finally:
        if not exited(stage):
            os.kill(stage, signal.SIGKILL)
    assert (out.kind, out.text) == ("ok", expected(folder[1], prompt))
    wait_until(lambda: exited(pid), 30, "the prefill worker to exit (StageLost)")
    wait_until(lambda: any("pipeline stage 1" in line for line in server.lines), 10,
               "serve to report why the prefill worker exited")  # fmt: skip
    # the router declared it dead: the decode worker prefilled the request itself
    assert metric(server.url, "pdserve_worker_failures_total") == failures + 1

    # serve restarts it with its stages; it registers again and takes remote prefills
    def restarted() -> bool:
        now = server.worker_pids().get("prefill-0")
        return now not in (None, pid) and len(stage_pids(now)) == 1

    wait_until(restarted, 60, "prefill-0 restarted with its stage")
    wait_until(lambda: "prefill-0" in server.health()["workers"], 60, "prefill-0 registered")
    server.wait_idle_and_clean()
    remote = metric(server.url, REMOTE)
    again = ask(server, PROMPT)
    assert (again.kind, again.text) == ("ok", expected(folder[1], PROMPT))
    assert metric(server.url, REMOTE) == remote + 1
    server.wait_idle_and_clean()
