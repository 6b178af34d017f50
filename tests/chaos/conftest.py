"""One `pdserve serve` for the whole chaos suite: 1 prefill + 2 decode workers, every prompt
through the prefill pool, float32 so greedy outputs compare token for token, a short heartbeat
timeout so a killed worker is noticed in ~2 s, and a lease shorter than any test's patience.
Tests kill and restart its workers themselves (`--no-restart`: serve's own supervision is
tested in tests/launch/test_supervision.py); each starts with `cluster.ensure_all()` as it
needs."""

from __future__ import annotations

import pytest
from servers import Server

from .cluster import Cluster

HEARTBEAT_TIMEOUT_S = 2.0
LEASE_S = 4.0
SERVE_ARGS = (
    "--mode",
    "disagg",
    "--prefill",
    "1",
    "--decode",
    "2",
    "--dtype",
    "float32",
    "--local-prefill-threshold",
    "0",
    "--heartbeat-timeout-s",
    str(HEARTBEAT_TIMEOUT_S),
    "--lease-s",
    str(LEASE_S),
    "--kv-cache-gb",
    "0.5",  # ~11k tokens per worker: plenty here, and the whole test suite fits in memory
    "--no-restart",  # the tests restart the workers they kill (Cluster.restart)
)


@pytest.fixture(scope="package")  # stopped after its tests: the suite must fit in memory
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("chaos-workers")
    with Server(*SERVE_ARGS) as server, Cluster(server, log_dir) as c:
        yield c
