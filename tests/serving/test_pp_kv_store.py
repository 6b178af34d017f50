"""`pdserve serve --prefill-pp 2 --kv-store` end to end on the bundled model (float32, 15 + 15
layers): the prefill pipeline's KV store link, in stage 0, reaches both stages' layers. A
prompt goes through the pipeline and its blocks reach the store; the prefill worker is then
killed (kill -9: its prefix cache is gone) and `serve` restarts it with both stages; the next
turn, which extends the prompt, is prefilled by the new pipeline, which loads the prompt's
blocks from the store into both stages' caches instead of computing them (its store hits in
/health), and its greedy tokens are those of a worker without a pipeline or a store. (Loads
and offloads of every stage's layers, byte for byte: tests/kv_store/test_store_link_pp.py.)"""

from __future__ import annotations

import os
import signal

import pytest
from servers import Server, exited, metric
from waiting import wait_until

from serving.test_kv_store_serving import SYSTEM, complete, store_hits, wait_store_known
from serving.test_pp_served import REMOTE, stage_pids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with Server(
        "--mode", "disagg", "--dtype", "float32", "--prefill", "1", "--decode", "1",
        "--prefill-pp", "2", "--kv-store", "--local-prefill-threshold", "0",
        "--heartbeat-timeout-s", "3", "--kv-cache-gb", "0.25",
    ) as server:  # fmt: skip
        yield server


def text(server: Server, prompt: str) -> str:
    return complete(server, prompt)["choices"][0]["text"]


def test_a_restarted_pipeline_loads_the_prompt_from_the_store_into_both_stages(
    server, disagg_server
):
    turn1 = SYSTEM + "\nUser: When does zone 4 ship?\nAssistant:"
    remote = metric(server.url, REMOTE)
    first = text(server, turn1)
    assert first == text(disagg_server, turn1)
    assert metric(server.url, REMOTE) == remote + 1  # prefilled by the pipeline
    wait_store_known(server, 640)  # the prompt's blocks reached the store

    pid = server.worker_pids()["prefill-0"]
    os.kill(pid, signal.SIGKILL)  # its stage exits with it
    wait_until(lambda: exited(pid), 30, "the prefill worker to exit")

    def restarted() -> bool:
        now = server.worker_pids().get("prefill-0")
        return now not in (None, pid) and len(stage_pids(now)) == 1

    wait_until(restarted, 120, "prefill-0 restarted with its stage")
    new = server.worker_pids()["prefill-0"]
    # the new process registered (until the router declares the killed one lost, /health may
    # still list it under the same id: then a turn finds no prefill worker)
    wait_until(lambda: server.health()["workers"].get("prefill-0", {}).get("pid") == new, 120,
               "the restarted prefill-0 registered")  # fmt: skip

    turn2 = turn1 + first + "\nUser: And zone 7?\nAssistant:"
    remote = metric(server.url, REMOTE)
    assert text(server, turn2) == text(disagg_server, turn2)
    assert metric(server.url, REMOTE) == remote + 1
    wait_until(lambda: store_hits(server).get("prefill-0", 0) >= 400, 30,
               "the new pipeline's store hits in its load report",
               state=lambda: store_hits(server))  # fmt: skip
    server.wait_idle_and_clean()
