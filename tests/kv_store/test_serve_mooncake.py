"""`pdserve serve --kv-store --kv-store-backend mooncake`: a loopback mooncake_master started
for a one-host trial, worker processes offloading to its pool and loading from it, outputs
unchanged (float32, greedy), also from a prefill pipeline of 2 stages (`--prefill-pp 2`: stage
0's store client registers the later stage's caches, mapped from its shared memory); the
backend flag without --kv-store is refused."""

from __future__ import annotations

import pytest
from servers import Server, metric, run_serve
from serving.test_kv_store_serving import (
    SYSTEM,
    complete,
    store_hits,
    wait_store_hits,
    wait_store_known,
)
from serving.test_pp_served import REMOTE
from waiting import wait_until

from kv_store.helpers import MOONCAKE_SKIP

SKIP = pytest.mark.skipif(MOONCAKE_SKIP is not None, reason=str(MOONCAKE_SKIP))
pytestmark = [pytest.mark.slow, SKIP]


def test_a_mooncake_pool_serves_warm_turns_with_identical_output():
    with Server(
        "--mode", "disagg", "--dtype", "float32", "--kv-store", "--kv-store-backend", "mooncake",
        "--store-dram-gb", "0.0625", "--no-prefix-caching",  # the warm turn: only from the pool
        "--kv-cache-gb", "0.25",
    ) as server:  # fmt: skip
        assert server.child_pids("mooncake_master")
        assert server.child_pids("--kv-store mooncake://127.0.0.1:")
        prompt = SYSTEM + "\nUser: When does zone 4 ship?\nAssistant:"
        cold = complete(server, prompt)["choices"][0]["text"]  # computed: the pool is empty
        assert sum(store_hits(server).values()) == 0
        wait_store_known(server, 640)  # the router's index, fed from the pool
        warm = complete(server, prompt)["choices"][0]["text"]
        assert warm == cold
        wait_store_hits(server, 400)
        server.wait_idle_and_clean()


def test_a_prefill_pipeline_offloads_and_loads_every_stages_layers_through_the_pool():
    """The warm turn is prefilled by the pipeline from the pool alone (no prefix cache): both
    stages' layers came back from Mooncake, or its tokens would differ from the cold turn's."""
    with Server(
        "--mode", "disagg", "--dtype", "float32", "--kv-store", "--kv-store-backend", "mooncake",
        "--store-dram-gb", "0.0625", "--no-prefix-caching", "--kv-cache-gb", "0.25",
        "--prefill-pp", "2", "--local-prefill-threshold", "0",
    ) as server:  # fmt: skip
        prompt = SYSTEM + "\nUser: Which zones ship on Fridays?\nAssistant:"
        remote = metric(server.url, REMOTE)
        cold = complete(server, prompt)["choices"][0]["text"]
        wait_store_known(server, 640)
        warm = complete(server, prompt)["choices"][0]["text"]
        assert warm == cold
        assert metric(server.url, REMOTE) == remote + 2  # both turns through the pipeline
        wait_until(
            lambda: store_hits(server).get("prefill-0", 0) >= 400, 30,
            "the pipeline's store hits in its load reports", state=lambda: store_hits(server),
        )  # fmt: skip
        server.wait_idle_and_clean()


def test_the_backend_flag_alone_is_refused():
    done = run_serve("--kv-store-backend", "mooncake", timeout_s=60)
    assert done.returncode != 0 and "add --kv-store" in done.stderr + done.stdout
