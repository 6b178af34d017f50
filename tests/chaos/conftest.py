"""One `pdserve serve` for the whole chaos suite: 1 prefill + 2 decode workers, every prompt
through the prefill pool, float32 so greedy outputs compare token for token, a short heartbeat
timeout so a killed worker is noticed in ~2 s, and a lease shorter than any test's patience.
Tests kill and restart its workers themselves (`--no-restart`: serve's own supervision is
tested in tests/launch/test_supervision.py); each starts with `cluster.ensure_all()` as it
needs. Tracing is on (where pdserve[otel] is installed), to an OTLP receiver in the test
process: `receiver` holds every span, so a test can follow a request through its faults."""

from __future__ import annotations

import importlib.util

import pytest
from servers import Server

from .cluster import Cluster


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is absent
        return False


TRACING = _installed("opentelemetry.exporter.otlp.proto.http")

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


@pytest.fixture(scope="package")
def receiver():
    """The OTLP receiver the cluster's processes send their spans to (None: no pdserve[otel])."""
    if not TRACING:
        yield None
        return
    from otlp_receiver import Receiver

    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="package")  # stopped after its tests: the suite must fit in memory
def cluster(tmp_path_factory, receiver):
    log_dir = tmp_path_factory.mktemp("chaos-workers")
    args, env = SERVE_ARGS, None
    if receiver is not None:  # spans sent every 100 ms: a worker killed later has sent its own
        args, env = (
            (*SERVE_ARGS, "--otlp-traces-endpoint", receiver.url),
            {"OTEL_BSP_SCHEDULE_DELAY": "100"},
        )
    with Server(*args, env=env) as server, Cluster(server, log_dir) as c:
        yield c
