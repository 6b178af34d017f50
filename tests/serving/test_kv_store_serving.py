"""Issue 6 end to end: `pdserve serve --kv-store` (Mooncake-style pool + cache-aware routing)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from .conftest import Server

pytestmark = pytest.mark.slow
SYSTEM = "You are a meticulous assistant for a logistics company. " + " ".join(
    f"Rule {i}: shipments to zone {i % 9} leave on weekday {i % 5} with priority {i % 3}."
    for i in range(40)
)


def child_pids(server: Server, needle: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server.proc.pid and needle in cmd:
            out.append(int(pid))
    return out


def complete(server: Server, prompt: str, max_tokens: int = 12) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def store_hits(server: Server) -> dict[str, int]:
    return {wid: w.get("store_hit_tokens", 0) for wid, w in server.health()["workers"].items()}


@pytest.fixture(scope="module")
def store_server():
    server = Server(
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
    )
    yield server
    server.stop()


def test_outputs_identical_with_store_and_warm_turns_hit_it(store_server, disagg_server):
    turn1 = SYSTEM + "\nUser: When does zone 4 ship?\nAssistant:"
    first = complete(store_server, turn1)["choices"][0]["text"]
    assert (
        first == complete(disagg_server, turn1)["choices"][0]["text"]
    )  # same tokens, store or not
    # Offload is asynchronous; heartbeats tell the router what the store holds. Wait for it
    # (a fixed sleep flaked on a busy machine: turn 2 then looked cold and went to P).
    deadline = time.monotonic() + 30
    while store_server.health().get("kv_store_blocks_known", 0) < 40:
        assert time.monotonic() < deadline, store_server.health()
        time.sleep(0.2)
    # Kill the decode worker that served turn 1: its local prefix cache is gone with it.
    decoders = [kv for kv in store_server.health()["workers"].items() if kv[1]["role"] == "decode"]
    holder = max(decoders, key=lambda kv: kv[1].get("prefix_query_tokens", 0))  # not P: it ties
    victim = [p for p in child_pids(store_server, f"--worker-id {holder[0]} ")]
    assert victim, holder
    os.kill(victim[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while holder[0] in store_server.health()["workers"] and time.monotonic() < deadline:
        time.sleep(0.5)
    turn2 = turn1 + first + "\nUser: And zone 7?\nAssistant:"
    second = complete(store_server, turn2)["choices"][0]["text"]
    assert second == complete(disagg_server, turn2)["choices"][0]["text"]
    hits = store_hits(store_server)
    assert sum(hits.values()) >= 400, hits  # the surviving worker loaded the shared prefix
    metrics = httpx.get(store_server.url + "/metrics").text
    assert 'pdserve_cache_temperature_total{cache="warm"}' in metrics


def test_store_killed_mid_run_falls_back_to_computing(store_server):
    stores = child_pids(store_server, "pdserve.cli store")
    assert len(stores) == 1
    os.kill(stores[0], signal.SIGKILL)
    for i in range(3):
        out = complete(store_server, SYSTEM + f"\nUser: question {i}?\nAssistant:", max_tokens=6)
        assert out["usage"]["completion_tokens"] == 6
    workers = store_server.wait_idle_and_clean()
    for w in workers.values():
        assert w["free_blocks"] == w["total_blocks"] and w["integrity_error"] is None, workers
