"""The nixl KV transport across hosts: a second deployment on the package's hosts, its router on
the router host (ports 8001 and 7001), p1 on the prefill host and d1 on the decode host, both
with --kv-transport nixl. It has a router of its own because a router pairs any prefill worker
with any decode worker and does not know their transports (tcp p0 could be sent to nixl d1).
The decode worker READs the KV from the prefill worker's memory (NIXL over UCX); the greedy
text is the offline engine's and the bytes left the prefill host and reached the decode host."""

from __future__ import annotations

import pytest
from kv_transfer.helpers import HAS_NIXL, NIXL_SKIP

from .conftest import (
    DECODE,
    ENGINE,
    ROUTER,
    ROUTER_READY,
    WORKER_READY,
    Service,
    assert_kv_crossed,
    notes,
    router_argv,
    start_all,
    stop_all,
)

pytestmark = pytest.mark.skipif(not HAS_NIXL, reason=NIXL_SKIP)
NIXL_HTTP_PORT, NIXL_CONTROL_PORT = 8001, 7001
# UCX takes these hosts for one machine (one hostname, one boot id) and would move the KV through
# shared memory (25.8 MB of a push, 43 KB on the link): only its TCP transport, as between
# machines without RDMA.
UCX_OVER_THE_LINK = {"UCX_TLS": "tcp"}


@pytest.fixture(scope="module")
def nixl(cluster) -> Service:
    hosts = cluster.hosts
    argv = router_argv(ROUTER, NIXL_HTTP_PORT, NIXL_CONTROL_PORT)
    procs = start_all({"router": (hosts["router"], argv, ROUTER_READY)})
    try:
        common = ["--router", f"tcp://{ROUTER}:{NIXL_CONTROL_PORT}", "--kv-transport", "nixl",
                  "--router-timeout-s", "4", *ENGINE]  # fmt: skip
        procs |= start_all({
            "prefill": (hosts["prefill"], ["worker", "--role", "prefill", "--worker-id", "p1",
                        *common], WORKER_READY),
            "decode": (hosts["decode"], ["worker", "--role", "decode", "--worker-id", "d1",
                       "--kv-host", DECODE, *common], WORKER_READY),
        }, env=UCX_OVER_THE_LINK)  # fmt: skip
        service = Service(cluster.client, f"http://{ROUTER}:{NIXL_HTTP_PORT}", {"p1", "d1"})
        service.wait_clean(60)
        yield service
    finally:
        stop_all(procs)


def test_nixl_kv_crosses_from_the_prefill_host_to_the_decode_host(cluster, nixl, offline):
    hosts = cluster.hosts
    assert_kv_crossed(nixl, offline, notes(11), hosts["prefill"], hosts["decode"])
    nixl.wait_clean()
