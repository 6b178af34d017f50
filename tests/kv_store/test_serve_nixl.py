"""`pdserve serve --kv-store --kv-transport nixl`: the store started over NIXL, workers offloading
to it and loading from it by NIXL READs, outputs unchanged (float32, greedy)."""

from __future__ import annotations

import time

import pytest
from kv_transfer.helpers import HAS_NIXL, NIXL_SKIP
from serving.conftest import Server
from serving.test_kv_store_serving import SYSTEM, child_pids, complete, store_hits

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_NIXL, reason=NIXL_SKIP)]


def test_a_nixl_store_serves_warm_turns_with_identical_output():
    server = Server(
        "--mode", "disagg", "--dtype", "float32", "--kv-transport", "nixl", "--kv-store",
        "--no-prefix-caching",  # so the warm turn can only come from the store
        "--kv-cache-gb", "0.25",
    )  # fmt: skip
    try:
        assert child_pids(server, "--transport nixl")  # the store; workers reach it by NIXL
        assert child_pids(server, "--kv-store nixl://")
        prompt = SYSTEM + "\nUser: When does zone 4 ship?\nAssistant:"
        cold = complete(server, prompt)["choices"][0]["text"]  # computed: the store is empty
        assert sum(store_hits(server).values()) == 0
        deadline = time.monotonic() + 30  # offload is asynchronous; heartbeats report it
        while server.health().get("kv_store_blocks_known", 0) < 40:
            assert time.monotonic() < deadline, server.health()
            time.sleep(0.2)
        warm = complete(server, prompt)["choices"][0]["text"]
        assert warm == cold  # the prefix loaded from the store gives the same tokens
        hits = store_hits(server)
        assert sum(hits.values()) >= 400, hits
        workers = server.wait_idle_and_clean()
        for w in workers.values():
            assert w["free_blocks"] == w["total_blocks"] and w["integrity_error"] is None
    finally:
        server.stop()
