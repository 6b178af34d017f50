"""One `pdserve serve` with an API key and a control-channel secret (PDSERVE_SECRET, inherited
by the workers), for the security suite."""

from __future__ import annotations

import pytest
from chaos.cluster import Cluster
from servers import Server

API_KEY = "sk-test-0123456789abcdef"
SECRET = "c0ffee" * 8  # 48 bytes: above the KV channel's minimum secret length


@pytest.fixture(scope="package")  # stopped after its tests: the suite must fit in memory
def secured(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("security-workers")
    with (
        Server(
            "--api-key",
            API_KEY,
            "--max-model-len",
            "256",
            "--kv-cache-gb",
            "0.25",
            env={"PDSERVE_SECRET": SECRET},
        ) as server,
        Cluster(server, log_dir) as c,
    ):
        yield c
