"""`pdserve serve --kv-store --kv-transport nixl`: the store started over NIXL, workers offloading
to it and loading from it by NIXL READs, outputs unchanged (float32, greedy)."""

from __future__ import annotations

import pytest
from kv_transfer.helpers import HAS_NIXL, NIXL_SKIP
from servers import Server
from serving.test_kv_store_serving import (
    SYSTEM,
    complete,
    store_hits,
    wait_store_hits,
    wait_store_known,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_NIXL, reason=NIXL_SKIP)]


def test_a_nixl_store_serves_warm_turns_with_identical_output():
    with Server(
        "--mode", "disagg", "--dtype", "float32", "--kv-transport", "nixl", "--kv-store",
        "--no-prefix-caching",  # so the warm turn can only come from the store
        "--kv-cache-gb", "0.25",
    ) as server:  # fmt: skip
        assert server.child_pids("--transport nixl")  # the store; workers reach it by NIXL
        assert server.child_pids("--kv-store nixl://")
        prompt = SYSTEM + "\nUser: When does zone 4 ship?\nAssistant:"
        cold = complete(server, prompt)["choices"][0]["text"]  # computed: the store is empty
        assert sum(store_hits(server).values()) == 0
        wait_store_known(server, 640)
        warm = complete(server, prompt)["choices"][0]["text"]
        assert warm == cold  # the prefix loaded from the store gives the same tokens
        wait_store_hits(server, 400)
        server.wait_idle_and_clean()  # every block free, block manager intact
