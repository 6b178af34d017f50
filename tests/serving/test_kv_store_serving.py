"""Issue 6 end to end: `pdserve serve --kv-store` (Mooncake-style pool + cache-aware routing)."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from servers import Server
from waiting import wait_until

from pdserve.config import default_block_size

pytestmark = pytest.mark.slow
SYSTEM = "You are a meticulous assistant for a logistics company. " + " ".join(
    f"Rule {i}: shipments to zone {i % 9} leave on weekday {i % 5} with priority {i % 3}."
    for i in range(40)
)


def complete(server: Server, prompt: str, max_tokens: int = 12) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def store_hits(server: Server) -> dict[str, int]:
    return {wid: w.get("store_hit_tokens", 0) for wid, w in server.health()["workers"].items()}


def wait_store_hits(server: Server, tokens: int) -> None:
    """Store hits come with each worker's next heartbeat after the turn that made them."""
    wait_until(
        lambda: sum(store_hits(server).values()) >= tokens,
        30,
        f"store hits of >= {tokens} tokens in the workers' load reports",
        state=lambda: store_hits(server),
    )


def wait_store_known(server: Server, tokens: int) -> None:
    """Offload is asynchronous; heartbeats tell the router what the store holds. Wait until it
    knows of the blocks of `tokens` tokens (a fixed sleep flaked on a busy machine: the next
    turn then looked cold and went to P)."""
    blocks = tokens // default_block_size(colocated=False)  # these servers are disaggregated
    wait_until(
        lambda: server.health().get("kv_store_blocks_known", 0) >= blocks,
        30,
        f"the router to know of {blocks} blocks in the KV store",
        interval_s=0.2,
        state=server.health,
    )


@pytest.fixture(scope="module")
def store_server():
    with Server(
        "--mode",
        "disagg",
        "--dtype",
        "float32",
        "--decode",
        "2",
        "--prefill",
        "1",
        "--kv-store",
        "--heartbeat-timeout-s",
        "3",
        "--kv-cache-gb",
        "0.25",
        "--no-restart",  # a killed decode worker stays dead (its prefix cache gone with it)
    ) as server:
        yield server


def test_outputs_identical_with_store_and_warm_turns_hit_it(store_server, disagg_server):
    turn1 = SYSTEM + "\nUser: When does zone 4 ship?\nAssistant:"
    first = complete(store_server, turn1)["choices"][0]["text"]
    assert (
        first == complete(disagg_server, turn1)["choices"][0]["text"]
    )  # same tokens, store or not
    wait_store_known(store_server, 640)
    # Kill the decode worker that served turn 1: its local prefix cache is gone with it.
    decoders = [kv for kv in store_server.health()["workers"].items() if kv[1]["role"] == "decode"]
    holder = max(decoders, key=lambda kv: kv[1].get("prefix_query_tokens", 0))  # not P: it ties
    pids = store_server.worker_pids()
    assert holder[0] in pids, (holder, pids)
    os.kill(pids[holder[0]], signal.SIGKILL)
    wait_until(
        lambda: holder[0] not in store_server.health()["workers"],
        30,
        f"the router to declare {holder[0]} dead",
        interval_s=0.2,
    )
    turn2 = turn1 + first + "\nUser: And zone 7?\nAssistant:"
    second = complete(store_server, turn2)["choices"][0]["text"]
    assert second == complete(disagg_server, turn2)["choices"][0]["text"]
    wait_store_hits(store_server, 400)  # the surviving worker loaded the shared prefix
    metrics = httpx.get(store_server.url + "/metrics").text
    assert 'pdserve_cache_temperature_total{cache="warm"}' in metrics


def test_store_killed_mid_run_falls_back_to_computing(store_server):
    stores = store_server.child_pids("pdserve.cli store ")
    assert len(stores) == 1
    os.kill(stores[0], signal.SIGKILL)
    for i in range(3):
        out = complete(store_server, SYSTEM + f"\nUser: question {i}?\nAssistant:", max_tokens=6)
        assert out["usage"]["completion_tokens"] == 6
    store_server.wait_idle_and_clean()  # every block free, block manager intact
